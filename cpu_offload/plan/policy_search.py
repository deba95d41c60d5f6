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

Stacks whose layers differ (:meth:`PolicySearch.of_layers`, one :class:`LayerCosts` per
layer, as ``offload_layers(model, memory_budget=...)`` measures them) are searched the
same way, then the table's answer is improved by a local search (``many_policies.py``):
NOTE [Layers that differ].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..device.profiles import DeviceProfile, get_profile
from ..engine.host_buffers import CLASS_DIVISIONS, pool_reserve
from ..engine.schedule import max_offloaded
from ..policy.memory_budget import size
from ..policy.policy import CHECKPOINT, CHECKPOINT_OFFLOAD, KEEP, OFFLOAD, POLICY_CHOICES
from .census import LayerProfile
from .many_policies import improve, order, simulate_many
from .policy_plan import PolicyPlan
from .schedule_model import LayerCosts, PlanRow, simulate_policy

__all__ = [
    "MAX_SEARCH_LAYERS",
    "PolicyPlan",
    "PolicySearch",
    "choose_policy",
    "whole_or_sliced",
    "policy_family",
    "simulate_many",
]

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


# NOTE [Layers that differ]
# A stack whose layers differ is given as one LayerCosts per layer: every candidate of the
# family then runs with each layer's own bytes and times, and the family's 8 best are
# each improved by the local search of many_policies.py (one layer's choice changed, or
# two layers' choices swapped, the best move taken while it is better); the best result
# is the answer.  Against a brute force over all 4^L policies (L = 4 to 7, 64 random
# stacks whose layers each draw their saved bytes, offloadable share, inputs and compute,
# on links from slow to fast; 2,509 budgets), the family alone is the optimum for 58% of
# budgets, up to 2.1x slower otherwise, and finds nothing that fits for 11 budgets where
# a policy does; with the local search it is the optimum for 97.0% of budgets and at
# most 8.1% slower otherwise (the optimum then changes three layers at once).  For
# layers alike (a stack given as one profile) the table alone answers, as before.
# tests/plan/test_policy.py keeps the bounds.

#: how many of the family's best policies the local search starts from
LOCAL_SEARCH_STARTS = 8


def _layers(positions: list[int], names: Sequence[str]) -> str:
    """``"layer 3 (Block)"``, ``"layers 0-31"``: positions as runs, with their class
    where they share one."""
    runs: list[list[int]] = []
    for j in positions:
        if runs and runs[-1][1] == j - 1:
            runs[-1][1] = j
        else:
            runs.append([j, j])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
    kinds = {names[j] for j in positions if j < len(names)}
    kind = f" ({kinds.pop()})" if len(kinds) == 1 and len(names) > max(positions) else ""
    return f"layer{'s' if len(positions) > 1 else ''} {text}{kind}"


def _check_layers(num_layers: object) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"choose_policy: num_layers must be an int, got {num_layers!r}.")
    if not 1 <= num_layers <= MAX_SEARCH_LAYERS:
        raise ValueError(
            f"choose_policy: num_layers must be in 1..{MAX_SEARCH_LAYERS}, got "
            f"{num_layers}: the search compares a family of policies that grows as L^3."
        )


class PolicySearch:
    """Every candidate policy of a stack run once through the event model; answers any
    number of budgets from that table (and, for layers that differ, improves the answer
    by a local search: NOTE [Layers that differ]).

    Attributes:
        device: the device profile (None for :meth:`of_layers`: its costs carry times).
        costs: one :class:`LayerCosts` per layer.
        codes: the candidates (codes into ``POLICY_CHOICES``), one row each.
        results: their predictions (peak, end of forward, moved bytes, step time).
        checkpoint_refused: why some layers are never checkpointed.
    """

    device: DeviceProfile | None

    def __init__(
        self,
        layer: LayerProfile,
        num_layers: int,
        device: str | DeviceProfile = "h100",
        reload_slice_bytes: int | None = None,
        gradient_bytes: int = 0,
        on_demand: tuple[int, ...] = (),
    ) -> None:
        _check_layers(num_layers)
        self.device = get_profile(device)
        self.slice_bytes = reload_slice_bytes
        self.on_demand = on_demand  # sliced layers without prefetch
        hazards = list(layer.checkpoint_hazards)
        costs = LayerCosts.of(layer, self.device).per_layer(num_layers)
        if gradient_bytes:  # the peak of a step whose backward allocates the gradients
            costs = [replace(c, gradient_bytes=gradient_bytes) for c in costs]
        self._build(costs, self.device.d2h, self.device.h2d, [bool(hazards)] * num_layers)
        self.checkpoint_refused = hazards  # the same for every layer, said once
        self.layer_names = [layer.description] * num_layers if layer.description else []
        self.refine = False

    @classmethod
    def of_layers(
        cls,
        costs: Sequence[LayerCosts],
        d2h_bytes_per_s: float,
        h2d_bytes_per_s: float,
        *,
        hazards: Sequence[Sequence[str]] | None = None,
        modules: Sequence[int] | None = None,
        names: Sequence[str] = (),
        reload_slice_bytes: int | None = None,
    ) -> PolicySearch:
        """A search over a stack with one :class:`LayerCosts` per layer (their times
        measured or predicted; the link's bandwidth in each direction given).

        Args:
            costs: per layer, as :meth:`LayerCosts.of` or a measured step gives them.
            d2h_bytes_per_s, h2d_bytes_per_s: the link.
            hazards: per layer, why recomputing it changes training
                (:func:`cpu_offload.policy.policy.checkpoint_hazards`): a layer with any is
                never checkpointed.
            modules: per layer, which module it is (equal numbers: one module at several
                positions, checkpointed at all of them or at none).
            names: per layer, what it is, for the plan's table.
            reload_slice_bytes: offloaded layers reloaded in slices (NOTE [Reloading a
                layer in slices] in engine/reload_slices.py); None: whole.
        """
        L = len(costs)
        _check_layers(L)
        search = cls.__new__(cls)
        search.device = None
        search.slice_bytes = reload_slice_bytes
        search.on_demand = ()
        hazards = list(hazards) if hazards is not None else [[]] * L
        search._build(
            list(costs), d2h_bytes_per_s, h2d_bytes_per_s, [bool(h) for h in hazards], modules
        )
        where: dict[str, list[int]] = {}  # each hazard, said once for all its layers
        for j, found in enumerate(hazards):
            for hazard in found:
                where.setdefault(hazard, []).append(j)
        search.checkpoint_refused = [
            f"{_layers(at, names)}: {hazard}" for hazard, at in where.items()
        ]
        search.layer_names = list(names)
        search.refine = any(c != costs[0] for c in costs)
        return search

    def _build(
        self,
        costs: list[LayerCosts],
        d2h: float,
        h2d: float,
        no_checkpoint: Sequence[bool],
        modules: Sequence[int] | None = None,
    ) -> None:
        self.costs, self.d2h, self.h2d = costs, d2h, h2d
        self.no_checkpoint = np.array(no_checkpoint, dtype=bool)
        self.modules = None if modules is None else np.array(modules)
        codes = policy_family(len(costs))
        self.codes = codes[self.allowed(codes)]
        self.results = simulate_many(self.codes, costs, d2h, h2d, self.slice_bytes, self.on_demand)
        self.checkpoints = self.checkpointed(self.codes).sum(axis=1)

    @staticmethod
    def checkpointed(codes: np.ndarray) -> np.ndarray:
        return (codes == _C) | (codes == _CO)

    def allowed(self, codes: np.ndarray) -> np.ndarray:
        """Which rows of ``codes`` may be chosen: the last layer not offloaded, no layer
        with hazards checkpointed, one module's positions checkpointed alike."""
        L = codes.shape[1]
        beyond = codes[:, max_offloaded(L) :]
        ok = ~((beyond == _O) | (beyond == _CO)).any(axis=1)
        checkpointed = self.checkpointed(codes)
        ok &= ~(checkpointed & self.no_checkpoint[None, :]).any(axis=1)
        if self.modules is not None:
            for module in np.unique(self.modules):
                at = np.flatnonzero(self.modules == module)
                if len(at) > 1:
                    ok &= (checkpointed[:, at] == checkpointed[:, at[:1]]).all(axis=1)
        return ok

    def _rank(self, codes: np.ndarray, budget: int, host_cap: int | None) -> np.ndarray:
        results = simulate_many(
            codes, self.costs, self.d2h, self.h2d, self.slice_bytes, self.on_demand
        )
        return order(
            results.peak_bytes,
            results.step_s,
            results.offloaded_bytes,
            self.checkpointed(codes).sum(axis=1),
            budget,
            host_fits(results.offloaded_bytes, host_cap),
        )

    def choose(self, memory_budget: int, host_cap: int | None = None) -> PolicyPlan:
        """The fastest policy whose peak fits ``memory_budget`` bytes (ties: fewer bytes
        moved, then fewer layers checkpointed, then the earliest in a fixed order) and
        whose host bytes fit ``host_cap`` (NOTE [Plans under a host cap])."""
        if (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, int)
            or memory_budget < 0
        ):
            raise ValueError(
                "choose_policy: memory_budget must be a number of bytes >= 0, got "
                f"{memory_budget!r}."
            )
        results = self.results
        ranked = order(
            results.peak_bytes,
            results.step_s,
            results.offloaded_bytes,
            self.checkpoints,
            memory_budget,
            host_fits(results.offloaded_bytes, host_cap),
        )
        codes = self.codes[int(ranked[0])]
        if self.refine:  # NOTE [Layers that differ]
            rank = lambda c: self._rank(c, memory_budget, host_cap)  # noqa: E731
            found = np.array(
                [
                    improve(self.codes[int(start)], self.allowed, rank, 4 * len(self.costs))
                    for start in ranked[:LOCAL_SEARCH_STARTS]
                ]
            )
            codes = found[int(rank(found)[0])]
        policy = [POLICY_CHOICES[code] for code in codes]
        row = simulate_policy(
            policy,
            self.costs,
            self.d2h,
            self.h2d,
            reload_slice_bytes=self.slice_bytes,
            on_demand=self.on_demand,
        )
        binding = ""
        if row.peak_bytes > memory_budget:
            binding = "memory_budget"
            if host_cap is not None and (results.peak_bytes <= memory_budget).any():
                binding = "max_host_bytes"  # a policy fits the device, not the host
        fits = not binding
        why = "" if fits else self._why(row, memory_budget)
        if binding == "max_host_bytes":
            why = (
                f"why nothing fits: the host cap binds. Every policy that fits the budget of "
                f"{size(memory_budget)} moves more than max_host_bytes={size(host_cap or 0)} "
                "holds (with the pool's reserve); the closest that fits the host peaks at "
                f"{size(row.peak_bytes)}. Raise max_host_bytes or memory_budget."
            )
        return PolicyPlan(
            policy,
            fits,
            row,
            memory_budget,
            len(self.codes),
            self.checkpoint_refused,
            self.costs,
            self.layer_names,
            why,
            host_cap,
            int(pool_reserve(row.offloaded_bytes)),
            binding,
            reload_slice_bytes=self.slice_bytes,
            reload_on_demand_layers=tuple(j for j in self.on_demand if policy[j] == OFFLOAD),
        )

    def _why(self, row: PlanRow, budget: int) -> str:
        """Why no policy fits ``budget``: what the closest one holds at its peak."""
        at = max(row.log, key=lambda step: step[2])[0] if row.log else "its peak"
        largest = max(c.saved_bytes for c in self.costs)
        refused = (
            " (and some layers may not be checkpointed: below)" if self.no_checkpoint.any() else ""
        )
        return (
            f"why nothing fits: the closest policy found peaks at {size(row.peak_bytes)} (at "
            f"{at}), above the budget of {size(budget)}. A layer's saved activations are all "
            f"on the device during its backward (the largest layer saves {size(largest)}), "
            "the last layer is never offloaded, checkpointed layers keep what of their "
            f"inputs cannot move, and tensors too small to move stay{refused}."
        )


# NOTE [Plans under a host cap]
# With max_host_bytes, a policy fits only if the host pool can hold what it moves: with
# the default schedule every offloaded layer's copy is on the host at the end of the
# forward, so a policy needs pool_reserve(offloaded_bytes) (the bytes moved per step and
# the pool's rounding, host_buffers.py) <= the cap.  A policy over the cap would not run
# as predicted (the pool keeps on the device what it refuses), so it is never chosen:
# the search checkpoints where the host is short.  When nothing fits both, the closest
# policy that fits the host is chosen, and the plan says which limit binds.
def host_fits(offloaded_bytes: np.ndarray, host_cap: int | None) -> np.ndarray | None:
    """Which policies' moved bytes (with the pool's reserve: :func:`pool_reserve`, on an
    array) fit ``host_cap`` (None: all)."""
    if host_cap is None:
        return None
    return np.asarray(offloaded_bytes + offloaded_bytes // CLASS_DIVISIONS <= host_cap)


def whole_or_sliced(whole: PolicyPlan, *sliced: PolicyPlan) -> PolicyPlan:
    """The plan with whole-layer reloads where it fits; else the fastest of those in
    slices that fits, or (none fits) the one that peaks lowest.  Where whole layers
    fit, slices are not taken even when predicted faster: a slice's wait depends on
    when backward first takes from it (NOTE [Timing the slices of a reload])."""
    if whole.fits:
        return whole
    fitting = [plan for plan in sliced if plan.fits]
    if fitting:
        return min(fitting, key=lambda plan: plan.predicted.step_s)
    lowest = min(sliced, key=lambda plan: plan.predicted.peak_bytes)
    return lowest if lowest.predicted.peak_bytes < whole.predicted.peak_bytes else whole


def choose_policy(
    layer: LayerProfile,
    num_layers: int,
    device: str | DeviceProfile = "h100",
    *,
    memory_budget: int,
    host_cap: int | None = None,
    reload_slice_bytes: int | None = None,
    gradient_bytes: int = 0,
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
        host_cap: bytes of host memory the policy may hold (``max_host_bytes``), or None.
        reload_slice_bytes: offloaded layers may come back in slices of this many bytes
            (NOTE [Reloading a layer in slices] in engine/reload_slices.py): the plan
            reloads in slices (its ``reload_slice_bytes``) where only that fits the
            budget (or, where nothing fits, peaks lower); elsewhere whole layers, as
            without.
        gradient_bytes: each layer's parameter gradients, where the budget is to cover
            them as backward allocates them (``LayerCosts.gradient_bytes``); 0: the
            budget is on top of them.  With ``reload_slice_bytes``, the plan may then
            bring layer 0's slices on demand, without prefetch (its
            ``reload_on_demand_layers``; NOTE [Slices at the peak] in
            engine/reload_slices.py) where that fits and the prefetch does not (or
            fits slower: the lower peak may keep more layers).

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
    search = PolicySearch(layer, num_layers, device, gradient_bytes=gradient_bytes)
    whole = search.choose(memory_budget, host_cap)
    if reload_slice_bytes is None:
        return whole
    plans = [
        PolicySearch(layer, num_layers, device, reload_slice_bytes, gradient_bytes, on_demand)
        for on_demand in ([(), (0,)] if gradient_bytes else [()])
    ]
    return whole_or_sliced(whole, *(search.choose(memory_budget, host_cap) for search in plans))
