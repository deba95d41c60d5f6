"""A local search around a policy, for stacks whose layers differ.

The block family of ``policy_search.py`` is built for layers that are alike: what
matters there is how many layers take each choice.  Where layers differ (dense and
mixture-of-experts layers, a first or last layer of its own, the layers of a hybrid
model), *which* layers take a choice matters as well: offloading the layers whose
compute is long enough to hide their copies, checkpointing the ones whose recompute is
cheap.  So the family's answer is improved one step at a time: every policy one change
away (one layer's choice changed, or the choices of two layers swapped, which keeps the
number of offloaded layers and with it the schedule's release and reload points) is run
through the vectorised event model at once, and the best one is taken while it is better
(NOTE [Layers that differ] in policy_search.py states what this finds against every
policy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["improve", "neighbours", "order"]

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
