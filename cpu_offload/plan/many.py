"""The event model of ``schedule_model.simulate_policy`` for many policies at once.

A vectorized copy of :func:`~cpu_offload.plan.schedule_model.simulate_policy` (the
reference; the tests hold the two equal): one row per policy, as codes into
``POLICY_CHOICES``, every row run through the same steps with numpy.  The policy search
(``policy_search.py``) runs its whole family through it once per stack and device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.schedule import release_point, reload_point
from ..policy.policy import CHECKPOINT, CHECKPOINT_OFFLOAD, OFFLOAD, POLICY_CHOICES
from .schedule_model import LayerCosts, layer_costs, slice_sizes

__all__ = ["Many", "simulate_many"]

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
) -> Many:
    """:func:`simulate_policy` for every row of ``codes`` at once (no log); ``costs`` is
    one layer's, or one per layer; ``reload_slice_bytes``: offloaded layers reloaded in
    slices (as ``simulate_policy`` takes it)."""
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
    slices = [slice_sizes(c.offloaded_bytes, reload_slice_bytes) for c in each]
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
        sizes = slices[j]
        if len(sizes) > 1:  # the rows that offload j: the next slice as each is consumed
            sliced = codes[:, j] == _O
            extra = sizes[0] + sizes[1] - sum(sizes)  # two slices held, not all of them
            total += np.where(sliced, sizes[1], 0)
            held += np.where(sliced, extra, 0)
            clock, link = compute.copy(), copies.copy()
            for s, nbytes in enumerate(sizes):
                if s + 1 < len(sizes):
                    link = np.maximum(link, clock) + sizes[s + 1] / h2d_bytes_per_s
                clock += backward_s[j] * nbytes / each[j].offloaded_bytes
                if s + 1 < len(sizes):
                    np.maximum(clock, link, out=clock)
            compute = np.where(sliced, clock, compute + backward_s[j])
            copies = np.where(sliced, link, copies)
        else:
            compute += backward_s[j]
        np.maximum(peak, total, out=peak)
    total -= held
    np.maximum(peak, total + each[0].gradient_bytes, out=peak)
    return Many(end_of_forward, peak, (moved * offloaded).sum(axis=1), compute)
