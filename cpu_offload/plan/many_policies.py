"""Many policies at once: the event model of :mod:`schedule_model` vectorized, one row
per policy (codes into ``POLICY_CHOICES``), every row run through the same steps with
numpy (:func:`simulate_many`); the order the search ranks them in (:func:`order`); and
the local search that improves an answer for stacks whose layers differ
(:func:`improve`, NOTE [A local search around a policy]).  The policy search
(policy_search.py) runs its whole family through them once per stack and device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.schedule import release_point, reload_point
from ..policy.policy import CHECKPOINT, CHECKPOINT_OFFLOAD, OFFLOAD, POLICY_CHOICES
from .schedule_model import LayerCosts, layer_costs

__all__ = ["Many", "improve", "neighbours", "order", "simulate_many"]

_O, _C, _CO = (POLICY_CHOICES.index(c) for c in (OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD))


@dataclass
class Many:
    """:func:`simulate_many`'s results, one entry per policy."""

    end_of_forward_bytes: np.ndarray
    peak_bytes: np.ndarray
    offloaded_bytes: np.ndarray
    step_s: np.ndarray


def simulate_many(
    codes: np.ndarray,
    costs: LayerCosts | Sequence[LayerCosts],
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    reload_slice_bytes: int | None = None,
    on_demand: Sequence[int] = (),
) -> Many:
    """:func:`simulate_policy` for every row of ``codes`` at once (no log); ``costs`` is
    one layer's, or one per layer; ``reload_slice_bytes``: offloaded layers reloaded in
    slices (as ``simulate_policy`` takes it), those at the positions ``on_demand``
    without prefetch."""
    n, L = codes.shape
    rows = np.arange(n)
    offloaded = (codes == _O) | (codes == _CO)
    checkpointed = (codes == _C) | (codes == _CO)
    m = offloaded.sum(axis=1)
    by_rank = np.argsort(~offloaded, axis=1, kind="stable")  # offloaded layers first
    each = layer_costs(costs, L)  # the costs of each position

    def column(name: str, dtype: type = np.int64) -> np.ndarray:
        return np.array([getattr(c, name) for c in each], dtype=dtype)[None, :]

    saved_bytes, input_bytes = column("saved_bytes"), column("input_bytes")
    forward_s, backward_s = column("forward_s", np.float64)[0], column("backward_s", np.float64)[0]
    recompute_s = column("recompute", np.float64)[0]
    saved = np.where(checkpointed, input_bytes, saved_bytes)
    moved = np.where(codes == _O, column("offloaded_bytes"), 0)
    moved += np.where(codes == _CO, column("input_offloaded_bytes"), 0)
    # per position, the slices an offloaded layer comes back in; what its reload brings
    timed = [c.slices(reload_slice_bytes, j not in on_demand) for j, c in enumerate(each)]
    slices = [sizes for sizes, _ in timed]
    first = np.where(codes == _O, np.array([s[0] for s in slices])[None, :], moved)
    compute, copies = np.zeros(n), np.zeros(n)
    copy_done, reload_done = np.zeros((n, L)), np.zeros((n, L))
    total = np.zeros(n, dtype=np.int64)
    peak = np.zeros(n, dtype=np.int64)
    for j in range(L):
        if j >= 1:
            starts = offloaded[:, j - 1]
            done = np.maximum(copies, compute) + moved[:, j - 1] / d2h_bytes_per_s
            copies = np.where(starts, done, copies)
            copy_done[:, j - 1] = done
        rank = j - release_point(L, m, 0)  # the offloaded layer released here, if any
        released = (rank >= 0) & (rank < m)
        layer = by_rank[rows, np.clip(rank, 0, L - 1)]
        compute = np.where(released, np.maximum(compute, copy_done[rows, layer]), compute)
        total -= np.where(released, moved[rows, layer], 0)
        compute += forward_s[j]
        total += saved[:, j]
        np.maximum(peak, total, out=peak)
    end_of_forward = total.copy()
    held = np.zeros(n, dtype=np.int64)  # what the layer whose backward ran holds
    for j in reversed(range(L)):
        total -= held
        if j + 1 < L:
            total += each[j + 1].gradient_bytes
        rank = j - reload_point(L, m, 0)  # the offloaded layer reloaded here, if any
        reloaded = (rank >= 0) & (rank < m)
        layer = by_rank[rows, np.clip(rank, 0, L - 1)]
        done = np.maximum(copies, compute) + first[rows, layer] / h2d_bytes_per_s
        copies = np.where(reloaded, done, copies)
        reload_done[rows, layer] = np.where(reloaded, done, reload_done[rows, layer])
        total += np.where(reloaded, first[rows, layer], 0)
        compute = np.where(offloaded[:, j], np.maximum(compute, reload_done[:, j]), compute)
        compute += np.where(checkpointed[:, j], recompute_s[j], 0.0)
        total += np.where(checkpointed[:, j], saved_bytes[0, j] - input_bytes[0, j], 0)
        held = np.full(n, saved_bytes[0, j])
        if each[j].recompute_bytes:  # the model's own checkpoint recomputes it
            by_model = np.where(checkpointed[:, j], 0, each[j].recompute_bytes)
            total += by_model
            held += by_model
        sizes = slices[j]
        if len(sizes) > 1:  # the rows that offload j: the next slice as each is consumed
            sliced = codes[:, j] == _O
            second = sizes[1] if j not in on_demand else 0  # prefetched, or on demand
            extra = sizes[0] + second - sum(sizes)  # two slices held (one), not all of them
            total += np.where(sliced, second, 0)
            held += np.where(sliced, extra, 0)
            clock, link = compute.copy(), copies.copy()
            ready = [clock.copy() for _ in sizes]
            for pop in timed[j][1]:
                clock += pop.after
                for number in pop.issues:
                    link = ready[number] = np.maximum(link, clock) + sizes[number] / h2d_bytes_per_s
                if pop.wait >= 0:
                    np.maximum(clock, ready[pop.wait], out=clock)
            compute = np.where(sliced, clock, compute + backward_s[j])
            copies = np.where(sliced, link, copies)
        else:
            compute += backward_s[j]
        np.maximum(peak, total, out=peak)
    total -= held
    np.maximum(peak, total + each[0].gradient_bytes, out=peak)
    return Many(end_of_forward, peak, (moved * offloaded).sum(axis=1), compute)


# NOTE [A local search around a policy]
# A local search around a policy, for stacks whose layers differ.
#
# The block family of ``policy_search.py`` is built for layers that are alike: what
# matters there is how many layers take each choice.  Where layers differ (dense and
# mixture-of-experts layers, a first or last layer of its own, the layers of a hybrid
# model), *which* layers take a choice matters as well: offloading the layers whose
# compute is long enough to hide their copies, checkpointing the ones whose recompute is
# cheap.  So the family's answer is improved one step at a time: every policy one change
# away (one layer's choice changed, or the choices of two layers swapped, which keeps the
# number of offloaded layers and with it the schedule's release and reload points) is run
# through the vectorised event model at once, and the best one is taken while it is better
# (NOTE [Layers that differ] in policy_search.py states what this finds against every
# policy).
CHOICES = 4  # keep, offload, checkpoint, checkpoint+offload (codes 0..3)


def neighbours(policy: np.ndarray) -> np.ndarray:
    """Every policy (codes, one row each) one change away from ``policy``: one layer's
    choice changed, or two layers' choices swapped."""
    L = policy.shape[0]
    layer = np.repeat(np.arange(L), CHOICES)
    code = np.tile(np.arange(CHOICES, dtype=policy.dtype), L)
    changed = code != policy[layer]
    singles = np.repeat(policy[None, :], int(changed.sum()), axis=0)
    singles[np.arange(len(singles)), layer[changed]] = code[changed]
    first, second = np.triu_indices(L, 1)
    differ = policy[first] != policy[second]
    first, second = first[differ], second[differ]
    swaps = np.repeat(policy[None, :], len(first), axis=0)
    rows = np.arange(len(first))
    swaps[rows, first] = policy[second]
    swaps[rows, second] = policy[first]
    return np.concatenate([singles, swaps])


def order(
    peak: np.ndarray,
    step_s: np.ndarray,
    moved: np.ndarray,
    checkpoints: np.ndarray,
    budget: int,
    host_ok: np.ndarray | None = None,
) -> np.ndarray:
    """Indices from best to worst for ``budget``: policies that fit first, the fastest
    of them, then the fewest bytes moved, then the fewest layers checkpointed; where
    none fits, the smallest peak, then the fastest.  ``host_ok``: which policies fit the
    host cap; one that does not never comes before one that does."""
    fits = peak <= budget
    if host_ok is not None:
        fits &= host_ok
        peak = np.where(host_ok, peak, np.iinfo(np.int64).max)
    step = np.round(step_s, 12)
    first = np.where(fits, step, peak.astype(np.float64))
    then = np.where(fits, moved.astype(np.float64), step)
    return np.lexsort((checkpoints, then, first, ~fits))


def improve(
    start: np.ndarray,
    allowed: Callable[[np.ndarray], np.ndarray],
    rank: Callable[[np.ndarray], np.ndarray],
    rounds: int,
) -> np.ndarray:
    """From ``start``, move to the best allowed neighbour while ``rank`` puts it ahead.

    Args:
        start: a policy (codes).
        allowed: which rows of a code array may be chosen (a boolean per row).
        rank: the order (best first) of the rows of a code array (:func:`order` of
            their simulated results).
        rounds: at most this many moves.
    """
    current = start
    for _ in range(rounds):
        candidates = neighbours(current)
        candidates = candidates[allowed(candidates)]
        if not len(candidates):
            break
        both = np.concatenate([current[None, :], candidates])
        best = int(rank(both)[0])
        if best == 0:  # nothing one change away is better
            break
        current = both[best]
    return current
