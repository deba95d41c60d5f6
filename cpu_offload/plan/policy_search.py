"""Choose keep, offload, checkpoint or checkpoint+offload for every layer, for a memory
budget: the policy with the least predicted step time whose activations fit.

The search is exhaustive over a family of policies, not over all ``4^L``: every
policy made of four blocks, one per choice, in the orders of :data:`ORDERS` and of any
sizes (``offload`` x 10 then ``checkpoint`` x 6 then ``keep`` x 16, ...).  Why not a dynamic
program: the default schedule releases and reloads the ``r``-th offloaded layer at a
point set by ``r`` and the number ``m`` of offloaded layers, so a layer's cost depends
on every other layer's choice and no small per-layer state summarizes the prefix.  Why
this family: the layers of a stack are alike, so what matters is how many layers take
each choice and, through the schedule, how they are ordered; blocks are what a person
would write.  The two orders lose nothing against all 24 block orders (random profiles,
L = 6 to 16); against a brute force over all ``4^L`` policies (L = 4 to 7) the family's
best is the optimum for 96% of budgets and at most 6.8% slower otherwise, where the
optimum interleaves a checkpointed layer among the offloaded ones (the tests keep the
bound).  All policies are run at once through
a vectorized copy of the event model (:func:`simulate_policy` is the reference, and the
tests hold the two equal), once per layer, stack and device: every budget is answered
from the same table, so the predicted step time never decreases as the budget tightens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..policy import CHECKPOINT, CHECKPOINT_OFFLOAD, KEEP, OFFLOAD, POLICY_CHOICES, policy_runs
from ..schedule import max_offloaded, release_point, reload_point
from .census import LayerProfile
from .profiles import DeviceProfile, get_profile
from .schedule_model import LayerCosts, PlanRow, simulate_policy

__all__ = ["MAX_SEARCH_LAYERS", "PolicyPlan", "choose_policy", "policy_family", "simulate_many"]

#: the most layers the search takes: its family grows as L^3 (715,393 policies at 128
#: layers, a minute or two and about 2 GiB of memory), and 128 covers today's models
MAX_SEARCH_LAYERS = 128

_CODE = {choice: code for code, choice in enumerate(POLICY_CHOICES)}
_K, _O, _C, _CO = (_CODE[c] for c in (KEEP, OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD))


#: the block orders searched (see the module's docstring)
ORDERS = (
    (OFFLOAD, CHECKPOINT_OFFLOAD, CHECKPOINT, KEEP),
    (CHECKPOINT_OFFLOAD, CHECKPOINT, OFFLOAD, KEEP),
)


def policy_family(num_layers: int, orders: Sequence[Sequence[str]] = ORDERS) -> np.ndarray:
    """The candidate policies as codes (indices into ``POLICY_CHOICES``), one row each:
    four blocks in each of ``orders``, of any sizes, the last layer not offloaded."""
    L = num_layers
    sizes = np.array(
        [
            (a, b, c, L - a - b - c)
            for a in range(L + 1)
            for b in range(L + 1 - a)
            for c in range(L + 1 - a - b)
        ]
    )
    ends = np.cumsum(sizes, axis=1)  # where each block ends
    positions = np.arange(L)
    block = (positions[None, :] >= ends[:, 0:1]).astype(np.int8)
    block += positions[None, :] >= ends[:, 1:2]
    block += positions[None, :] >= ends[:, 2:3]
    rows = [np.array([_CODE[c] for c in order], dtype=np.int8)[block] for order in orders]
    codes = np.unique(np.concatenate(rows), axis=0)
    beyond = codes[:, max_offloaded(L) :]  # the layers the schedule never offloads
    return codes[~((beyond == _O) | (beyond == _CO)).any(axis=1)]


@dataclass
class _Many:
    """:func:`simulate_many`'s results, one entry per policy."""

    end_of_forward_bytes: np.ndarray
    peak_bytes: np.ndarray
    offloaded_bytes: np.ndarray
    step_s: np.ndarray


def simulate_many(
    codes: np.ndarray, costs: LayerCosts, d2h_bytes_per_s: float, h2d_bytes_per_s: float
) -> _Many:
    """:func:`simulate_policy` for every row of ``codes`` at once (no log)."""
    n, L = codes.shape
    rows = np.arange(n)
    offloaded = (codes == _O) | (codes == _CO)
    checkpointed = (codes == _C) | (codes == _CO)
    m = offloaded.sum(axis=1)
    by_rank = np.argsort(~offloaded, axis=1, kind="stable")  # offloaded layers first
    each = costs.per_layer(L)  # the costs of each position

    def column(name: str, dtype: type = np.int64) -> np.ndarray:
        return np.array([getattr(c, name) for c in each], dtype=dtype)[None, :]

    saved_bytes, input_bytes = column("saved_bytes"), column("input_bytes")
    forward_s, backward_s = column("forward_s", np.float64)[0], column("backward_s", np.float64)[0]
    recompute_s = column("recompute", np.float64)[0]
    saved = np.where(checkpointed, input_bytes, saved_bytes)
    moved = np.where(codes == _O, column("offloaded_bytes"), 0)
    moved += np.where(codes == _CO, column("input_offloaded_bytes"), 0)
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
    for j in reversed(range(L)):
        if j + 1 < L:
            total -= saved_bytes[0, j + 1]  # what any layer holds once its backward ran
        rank = j - reload_point(L, m, 0)  # the offloaded layer reloaded here, if any
        reloaded = (rank >= 0) & (rank < m)
        layer = by_rank[rows, np.clip(rank, 0, L - 1)]
        done = np.maximum(copies, compute) + moved[rows, layer] / h2d_bytes_per_s
        copies = np.where(reloaded, done, copies)
        reload_done[rows, layer] = np.where(reloaded, done, reload_done[rows, layer])
        total += np.where(reloaded, moved[rows, layer], 0)
        compute = np.where(offloaded[:, j], np.maximum(compute, reload_done[:, j]), compute)
        compute += np.where(checkpointed[:, j], recompute_s[j], 0.0)
        total += np.where(checkpointed[:, j], saved_bytes[0, j] - input_bytes[0, j], 0)
        compute += backward_s[j]
        np.maximum(peak, total, out=peak)
    return _Many(end_of_forward, peak, (moved * offloaded).sum(axis=1), compute)


@dataclass
class PolicyPlan:
    """The policy chosen for a memory budget, and what it is predicted to cost.

    Attributes:
        policy: one of ``POLICY_CHOICES`` per layer; pass it to
            ``offload_layers(model, policy=...)``.
        fits: whether its peak of saved activations fits the budget; when no policy
            fits, ``policy`` is the one with the smallest peak (the closest).
        predicted: the event model's row for it (``end_of_forward_bytes``,
            ``peak_bytes``, ``offloaded_bytes`` per step, ``step_s``, ``overhead``,
            ``recompute_s``, ``exposed_copy_s``, ``log``).
        memory_budget: the budget, in bytes of saved activations.
        candidates: how many policies were compared.
        checkpoint_refused: why no layer was checkpointed (the layer's
            ``checkpoint_hazards``); empty when checkpointing was among the choices.
    """

    policy: list[str]
    fits: bool
    predicted: PlanRow
    memory_budget: int
    candidates: int
    checkpoint_refused: list[str] = field(default_factory=list)

    def blocks(self) -> list[tuple[int, int, str]]:
        """``(first layer, last layer, choice)`` for each run of equal choices."""
        return policy_runs(self.policy)


class PolicySearch:
    """Every candidate policy of a stack run once through the event model; answers any
    number of budgets from that table."""

    def __init__(
        self, layer: LayerProfile, num_layers: int, device: str | DeviceProfile = "h100"
    ) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int):
            raise TypeError(f"choose_policy: num_layers must be an int, got {num_layers!r}.")
        if not 1 <= num_layers <= MAX_SEARCH_LAYERS:
            raise ValueError(
                f"choose_policy: num_layers must be in 1..{MAX_SEARCH_LAYERS}, got "
                f"{num_layers}: the search compares a family of policies that grows as L^3."
            )
        self.device = get_profile(device)
        self.costs = LayerCosts.of(layer, self.device)
        self.codes = policy_family(num_layers)
        self.checkpoint_refused = list(layer.checkpoint_hazards)
        if self.checkpoint_refused:  # recomputing this layer would change training
            self.codes = self.codes[~np.isin(self.codes, (_C, _CO)).any(axis=1)]
        self.results = simulate_many(self.codes, self.costs, self.device.d2h, self.device.h2d)
        self.checkpoints = ((self.codes == _C) | (self.codes == _CO)).sum(axis=1)

    def choose(self, memory_budget: int) -> PolicyPlan:
        """The fastest policy whose peak fits ``memory_budget`` bytes (ties: fewer bytes
        moved, then fewer layers checkpointed, then the earliest in a fixed order)."""
        if (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, int)
            or memory_budget < 0
        ):
            raise ValueError(
                "choose_policy: memory_budget must be a number of bytes >= 0, got "
                f"{memory_budget!r}."
            )
        results, checkpoints = self.results, self.checkpoints
        fits = results.peak_bytes <= memory_budget
        keys: tuple[np.ndarray, ...]
        if fits.any():
            keys = (checkpoints, results.offloaded_bytes, np.round(results.step_s, 12), ~fits)
        else:  # the closest: the smallest peak, then the fastest
            keys = (checkpoints, np.round(results.step_s, 12), results.peak_bytes)
        best = int(np.lexsort(keys)[0])
        policy = [POLICY_CHOICES[code] for code in self.codes[best]]
        row = simulate_policy(policy, self.costs, self.device.d2h, self.device.h2d)
        return PolicyPlan(
            policy,
            bool(fits.any()),
            row,
            memory_budget,
            len(self.codes),
            self.checkpoint_refused,
        )


def choose_policy(
    layer: LayerProfile,
    num_layers: int,
    device: str | DeviceProfile = "h100",
    *,
    memory_budget: int,
) -> PolicyPlan:
    """The per-layer policy with the least predicted step time whose saved activations
    fit ``memory_budget`` bytes at every point of the step.  A layer whose recompute
    would change training (``layer.checkpoint_hazards``) is never checkpointed: the
    plan's ``checkpoint_refused`` says why.

    Args:
        layer: from :func:`~cpu_offload.plan.measure_layer`.
        num_layers: ``L``, the layers of the stack (all like ``layer``).
        device: a profile name, a JSON file of ``python -m cpu_offload.check``, or a
            :class:`DeviceProfile`.
        memory_budget: bytes of saved activations allowed on the device.

    Example:
        >>> import torch
        >>> from cpu_offload.plan import choose_policy, measure_layer
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU())
        >>> layer = measure_layer(make, torch.empty(8192, 4096, device="meta"))
        >>> loose = choose_policy(layer, 8, "h100", memory_budget=2**40)
        >>> loose.policy == ["keep"] * 8, loose.fits
        (True, True)
        >>> tight = choose_policy(layer, 8, "h100", memory_budget=layer.saved_bytes * 3)
        >>> tight.fits, tight.predicted.peak_bytes <= layer.saved_bytes * 3
        (True, True)
    """
    return PolicySearch(layer, num_layers, device).choose(memory_budget)
