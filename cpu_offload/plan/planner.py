"""The planner: predictions for every k of a stack, and the answers drawn from them.

:func:`plan_offload` runs the event model (``schedule_model.py``) of the default schedule
for every k of ``L`` layers on a device profile, and, with a memory budget, the policy
search (``policy_search.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..device.profiles import DeviceProfile, get_profile
from ..engine.host_buffers import pool_reserve
from .census import LayerProfile
from .policy_search import PolicyPlan, choose_policy
from .schedule_model import LayerCosts, PlanRow, first_k, simulate_policy

__all__ = ["MAX_LAYERS", "Plan", "plan_offload"]

#: the most layers a plan takes: well above any model's (the largest have about 130), and
#: a table of every k that stays within seconds (it runs the model once per k: L^2 steps)
MAX_LAYERS = 512


@dataclass
class Plan:
    """Predictions for every k, and the answers drawn from them.

    Attributes:
        layer: the measured layer.
        device: the device profile.
        num_layers: ``L``.
        rows: one :class:`PlanRow` per k = 0 .. L - 1.
        overhead_budget: the step overhead allowed (a fraction).
        memory_budget: the activation memory allowed, in bytes, or None.
        policy: with a memory budget, the per-layer policy chosen for it (keep,
            offload, checkpoint, checkpoint+offload; see :func:`choose_policy`).
        host_cap: the host memory each rank may hold (``max_host_bytes``), or None.
    """

    layer: LayerProfile
    device: DeviceProfile
    num_layers: int
    rows: list[PlanRow]
    overhead_budget: float
    memory_budget: int | None
    policy: PolicyPlan | None = None
    host_cap: int | None = None

    def host_fits(self, row: PlanRow) -> bool:
        """Whether one rank's host memory for ``row`` (what it moves per step, with the
        pool's reserve) fits ``host_cap`` (True without a cap)."""
        return self.host_cap is None or pool_reserve(row.offloaded_bytes) <= self.host_cap

    @property
    def largest_hidden_k(self) -> int:
        """The largest k whose predicted overhead stays within the budget, among the k
        whose host memory fits ``host_cap`` (k = 0 moves nothing and always does)."""
        return max(
            row.k
            for row in self.rows
            if row.overhead <= self.overhead_budget and self.host_fits(row)
        )

    @property
    def smallest_fitting_k(self) -> int | None:
        """The smallest k whose peak activation memory fits the budget and whose host
        memory fits ``host_cap`` (None: none fits both, or no budget was given)."""
        if self.memory_budget is None:
            return None
        fitting = [
            row.k
            for row in self.rows
            if row.peak_bytes <= self.memory_budget and self.host_fits(row)
        ]
        return min(fitting) if fitting else None

    @property
    def needs_checkpointing(self) -> bool:
        """A memory budget was given and no k meets it (within the host cap, where one
        is given): offloading alone cannot fit; recompute (activation checkpointing)
        some layers."""
        return self.memory_budget is not None and self.smallest_fitting_k is None

    def uncapped(self) -> Plan:
        """The same plan without its host cap: what the answers would be on a host
        without a limit."""
        return dataclasses.replace(self, host_cap=None)


def plan_offload(
    layer: LayerProfile,
    num_layers: int,
    device: str | DeviceProfile = "h100",
    *,
    overhead_budget: float = 0.02,
    memory_budget: int | None = None,
    host_cap: int | None = None,
) -> Plan:
    """Predict memory and time of offloading k of ``num_layers`` copies of ``layer``.

    Args:
        layer: from :func:`~cpu_offload.plan.measure_layer`.
        num_layers: ``L``, the layers of the stack (all like ``layer``).
        device: a built-in profile name (``"h100"``, ``"h200"``, ``"a100"``,
            ``"gh200"``, ``"910b"``), a JSON file of ``python -m cpu_offload.check``,
            or a :class:`DeviceProfile`.
        overhead_budget: the step overhead the answer may cost (0.02: 2%).
        memory_budget: bytes of saved activations that must fit, or None; with one,
            ``plan.policy`` is the fastest per-layer policy that fits it.
        host_cap: bytes of host memory one rank may hold (``max_host_bytes``), or None;
            with a memory budget the policy fits it too (NOTE [Plans under a host cap]).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"plan_offload: num_layers must be an int, got {num_layers!r}.")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ValueError(
            f"plan_offload: num_layers must be in 1..{MAX_LAYERS}, got {num_layers} (the plan "
            f"runs its model once per k, L^2 steps; {MAX_LAYERS} is above any model's depth)."
        )
    profile = get_profile(device)
    costs = LayerCosts.of(layer, profile)
    rows = [
        simulate_policy(first_k(num_layers, k), costs, profile.d2h, profile.h2d)
        for k in range(num_layers)
    ]
    policy = None
    if memory_budget is not None:
        policy = choose_policy(
            layer, num_layers, profile, memory_budget=memory_budget, host_cap=host_cap
        )
    return Plan(layer, profile, num_layers, rows, overhead_budget, memory_budget, policy, host_cap)
