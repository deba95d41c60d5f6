"""The planner: predictions for every k of a stack, and the answers drawn from them.

:func:`plan_offload` runs the event model (``schedule_model.py``) of the default schedule
for every k of ``L`` layers on a device profile, and, with a memory budget, the policy
search (``policy_search.py``); with ``cuda_graph=True``, for a step captured in one CUDA
graph and replayed (NOTE [Planning a captured step]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from ..device.profiles import DeviceProfile, get_profile
from ..engine.host_buffers import pool_reserve
from .census import LayerProfile
from .policy_search import PolicyPlan, choose_policy
from .schedule_model import LayerCosts, PlanRow, first_k, simulate_policy

__all__ = ["MAX_LAYERS", "Plan", "graph_error", "plan_offload", "replay_profile"]

#: the most layers a plan takes: well above any model's (the largest have about 130), and
#: a table of every k that stays within seconds (it runs the model once per k: L^2 steps)
MAX_LAYERS = 512


# NOTE [Planning a captured step]
# With ``cuda_graph=True`` (``python -m cpu_offload.plan --cuda-graph``) the plan is for a
# whole training step, forward and backward of the L layers, captured once in one CUDA
# graph and replayed (the shape ``offload_layers(..., cuda_graph=True)`` captures).  In
# the event model's terms, what a replay changes:
#
# - Time: the eager model's one host term goes.  A layer takes its kernels' device time
#   or, where that is shorter, the host's time to issue them (``host_issue_s`` per
#   kernel: a launch-bound layer; ``DeviceProfile.compute_seconds``).  A replay issues
#   the whole step in one launch, so a layer takes its device time alone: the layers
#   are timed on :func:`replay_profile`, the profile with ``host_issue_s = 0``.  The
#   offloader's Python (its hooks, per tensor and per layer) and the issue of each copy
#   do not run at replay either; the eager model does not price them (they run while
#   the device is busy, or inside a launch-bound layer's host time), so nothing else is
#   taken off.  What stays: every kernel and copy, their device times (``launch_s`` per
#   kernel is kept: a graph's kernels start closer together, and the profiles have no
#   figure for how much, so the captured step errs long), the copies at the link's
#   bandwidth and the waits the schedule places.  A faster compute stream hides less
#   behind it: a launch-bound stack's copies are exposed under a graph where they were
#   hidden eagerly.  One replay costs the host one launch (``host_issue_s``:
#   :attr:`Plan.graph_launch_s`), issued before the device starts, as the eager step's
#   first kernel is; neither step time counts it.
# - Memory: a captured step allocates from the graph's private pool, which holds what
#   it served at the capture's peak for the graph's life; the offloader's pinned host
#   buffers are allocated before the capture, one set per offloaded layer, and stay
#   lent to their layer (the pool's ``retain`` mode: fixed addresses).  Their figures
#   are the eager step's peaks: the reload buffers live as long as eagerly (they are
#   counted in ``peak_bytes``), and with the default schedule every offloaded layer's
#   copy is on the host at the end of the forward, so the host already holds all the
#   step moves (with the pool's size classes: ``pool_reserve``).  What changes is how
#   long they are held: for the graph's life, between replays too, where an eager
#   step's activations and buffers go back to the allocators.  The device memory
#   the step's activations need is ``peak_bytes`` at every point of training (the
#   optimizer step and whatever runs outside the graph come on top of it), and the
#   host's is ``host_bytes_per_rank``, never shared with other work; the plan's JSON
#   says so per row (``graph_pool_bytes``, ``graph_host_bytes``).  As eagerly, the
#   figure is the saved activations: the pool also holds the step's temporaries, and
#   the parameters' gradients where the backward allocates them inside the graph.
#
# Checked against the real offload code captured whole (``cuda_graph=True``) and
# replayed on the modeled H100 (tests/plan/test_cuda_graph_replay.py): each replay's
# time, the bytes it moves, and the peak counted at the layer boundaries.
#
# Refused: a pipeline stage (``--pipeline-stages``), whose step runs its schedule's
# actions from Python, micro-batch by micro-batch, and whose stage model prices that
# eager order; and a device that is not CUDA (:func:`graph_error`).
def replay_profile(profile: DeviceProfile) -> DeviceProfile:
    """The profile a replayed CUDA graph's layers are timed on: no host issue time per
    kernel (NOTE [Planning a captured step])."""
    return replace(profile, host_issue_s=0.0)


def graph_error(profile: DeviceProfile) -> str | None:
    """Why a step on ``profile`` cannot be planned as a captured CUDA graph, or None."""
    if profile.runtime == "cuda":
        return None
    return (
        f"a CUDA graph needs a CUDA device; {profile.name} runs the {profile.runtime!r} "
        "runtime, whose graphs the planner does not price: pass a CUDA profile (h100, "
        "h200, a100, gh200) or plan it without a graph"
    )


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
        cuda_graph: the plan is for a step captured in one CUDA graph and replayed
            (NOTE [Planning a captured step]).
    """

    layer: LayerProfile
    device: DeviceProfile
    num_layers: int
    rows: list[PlanRow]
    overhead_budget: float
    memory_budget: int | None
    policy: PolicyPlan | None = None
    host_cap: int | None = None
    cuda_graph: bool = False

    @property
    def graph_launch_s(self) -> float:
        """Host time of one replay's launch (one issue of the profile), with
        :attr:`cuda_graph`; it precedes the device's work and is not in ``step_s``."""
        return self.device.host_issue_s

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
    cuda_graph: bool = False,
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
        cuda_graph: plan a step captured in one CUDA graph and replayed: no host issue
            time in its layers, its memory held for the graph's life (NOTE [Planning a
            captured step]); a CUDA device only (ValueError otherwise).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"plan_offload: num_layers must be an int, got {num_layers!r}.")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ValueError(
            f"plan_offload: num_layers must be in 1..{MAX_LAYERS}, got {num_layers} (the plan "
            f"runs its model once per k, L^2 steps; {MAX_LAYERS} is above any model's depth)."
        )
    profile = get_profile(device)
    timed = profile
    if cuda_graph:
        error = graph_error(profile)
        if error:
            raise ValueError(f"plan_offload: cuda_graph=True: {error}.")
        timed = replay_profile(profile)
    costs = LayerCosts.of(layer, timed)
    rows = [
        simulate_policy(first_k(num_layers, k), costs, profile.d2h, profile.h2d)
        for k in range(num_layers)
    ]
    policy = None
    if memory_budget is not None:
        policy = choose_policy(
            layer, num_layers, timed, memory_budget=memory_budget, host_cap=host_cap
        )
    return Plan(
        layer,
        profile,
        num_layers,
        rows,
        overhead_budget,
        memory_budget,
        policy,
        host_cap,
        cuda_graph=bool(cuda_graph),
    )
