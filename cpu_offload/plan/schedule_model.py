"""An event model of the default schedule, and the plan it gives for every k.

Two clocks, as on the device: the compute stream runs each layer's forward and backward
(FLOPs over the profile's rate); the offload stream runs the copies one after another at
the link's bandwidth.  The model takes the steps of :class:`DefaultOffloadSynchronizer`
where the code takes them:

- forward of layer ``j``: the offload of layer ``j - 1`` starts (after the compute stream
  reached this point); layer ``i`` is released when ``j == L - k + i``, and the release
  makes the compute stream wait for that copy;
- backward of layer ``j``: the layer above is released; the reload of layer ``i`` starts
  when ``j == L - 1 - k + i`` (after the compute stream reached this point; its device
  memory is allocated then); layer ``j``'s first pop makes the compute stream wait for
  its reload;
- end of backward: the last layer is released.

Every time it gives is a prediction.  Memory is the layers' saved activations only
(parameters, gradients and optimizer state come on top).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..policy import CHECKPOINTED, KEEP, OFFLOAD, OFFLOADED
from .census import LayerProfile
from .profiles import DeviceProfile, get_profile

if TYPE_CHECKING:
    from .policy_search import PolicyPlan

__all__ = [
    "MAX_LAYERS",
    "LayerCosts",
    "Plan",
    "PlanRow",
    "plan_offload",
    "simulate",
    "simulate_policy",
]

#: the most layers a plan takes: well above any model's (the largest have about 130), and
#: a table of every k that stays within seconds (it runs the model once per k: L^2 steps)
MAX_LAYERS = 512


@dataclass
class PlanRow:
    """The prediction for one k (times in seconds, memory in bytes).

    Attributes:
        k: layers offloaded.
        end_of_forward_bytes: saved activations on the device when the forward ends.
        peak_bytes: the most saved activations on the device at any step.
        offloaded_bytes: bytes copied to the host per step (and back).
        exposed_copy_s: time the compute stream waits for copies.
        step_s: forward plus backward, waits and recomputation included.
        overhead: ``step_s`` over the step without offload, minus one.
        log: ``(step, action, activations on the device after it)`` per step.
        recompute_s: time spent running checkpointed layers' forwards again.
    """

    k: int
    end_of_forward_bytes: int
    peak_bytes: int
    offloaded_bytes: int
    exposed_copy_s: float
    step_s: float
    overhead: float
    log: list[tuple[str, str, int]] = field(default_factory=list, repr=False)
    recompute_s: float = 0.0


@dataclass(frozen=True)
class LayerCosts:
    """What the event model needs of one layer (bytes, and seconds on the device).

    Attributes:
        saved_bytes, offloaded_bytes, kept_bytes: as in :class:`LayerProfile`.
        input_bytes: what a checkpointed layer keeps saved: its inputs.
        input_offloaded_bytes: what of those a checkpointed, offloaded layer copies.
        forward_s, backward_s: the layer's compute time.
        following: the costs of the layers after the first, where they differ (their
            input is the previous layer's output; NOTE [The layers after the first]).
    """

    saved_bytes: int
    offloaded_bytes: int
    kept_bytes: int
    forward_s: float
    backward_s: float
    input_bytes: int = 0
    input_offloaded_bytes: int = 0
    following: LayerCosts | None = None

    @classmethod
    def of(cls, layer: LayerProfile, device: DeviceProfile) -> LayerCosts:
        return cls(
            saved_bytes=layer.saved_bytes,
            offloaded_bytes=layer.offloaded_bytes,
            kept_bytes=layer.kept_bytes,
            forward_s=layer.forward_flops / device.flops_per_s,
            backward_s=layer.backward_flops / device.flops_per_s,
            input_bytes=layer.input_bytes,
            input_offloaded_bytes=layer.input_offloaded_bytes,
            following=None if layer.following is None else cls.of(layer.following, device),
        )

    def per_layer(self, num_layers: int) -> list[LayerCosts]:
        """The costs of each layer of a stack of ``num_layers``."""
        return [self] + [self.following or self] * (num_layers - 1)


def simulate(
    num_layers: int,
    k: int,
    *,
    saved_bytes: int,
    offloaded_bytes: int,
    kept_bytes: int,
    forward_s: float,
    backward_s: float,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
) -> PlanRow:
    """Run the default schedule of ``k`` of ``num_layers`` identical layers."""
    if not 0 <= k <= num_layers - 1:
        raise ValueError(f"simulate: k must be in [0, {num_layers - 1}], got {k}.")
    costs = LayerCosts(saved_bytes, offloaded_bytes, kept_bytes, forward_s, backward_s)
    return simulate_policy(_first_k(num_layers, k), costs, d2h_bytes_per_s, h2d_bytes_per_s)


def _first_k(num_layers: int, k: int) -> list[str]:
    """The policy of the default schedule with ``k`` layers offloaded."""
    return [OFFLOAD] * k + [KEEP] * (num_layers - k)


def simulate_policy(
    policy: Sequence[str],
    costs: LayerCosts,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    *,
    log: bool = True,
) -> PlanRow:
    """Run the default schedule with a per-layer policy (see :mod:`cpu_offload.policy`):
    the offloaded layers (``offload``, ``checkpoint+offload``) are released and reloaded
    as :class:`~cpu_offload.DefaultOffloadSynchronizer` schedules its ``offloaded_layers``;
    a checkpointed layer keeps its inputs saved and runs its forward again in backward,
    where its saved activations are back on the device until the layer below runs."""
    L = len(policy)
    offloaded = [j for j, choice in enumerate(policy) if choice in OFFLOADED]
    m = len(offloaded)
    release_at = {layer: L - m + rank for rank, layer in enumerate(offloaded)}
    reload_at = {layer: L - 1 - m + rank for rank, layer in enumerate(offloaded)}
    released_at = {at: layer for layer, at in release_at.items()}
    reloaded_at = {at: layer for layer, at in reload_at.items()}
    each = costs.per_layer(L)
    saved = [
        each[j].saved_bytes if c not in CHECKPOINTED else each[j].input_bytes
        for j, c in enumerate(policy)
    ]
    moved = [
        each[j].offloaded_bytes if c == OFFLOAD else each[j].input_offloaded_bytes
        for j, c in enumerate(policy)
    ]
    compute = copies = waited = 0.0
    resident = [0] * L  # each layer's saved bytes on the device
    total = 0  # their sum
    copy_done: dict[int, float] = {}
    reload_done: dict[int, float] = {}
    steps: list[tuple[str, str, int]] = []
    peak = 0

    def wait_for(done: float) -> None:
        nonlocal compute, waited
        if done > compute:
            waited += done - compute
            compute = done

    def hold(layer: int, nbytes: int) -> None:
        nonlocal total
        total += nbytes - resident[layer]
        resident[layer] = nbytes

    def note(step: str, actions: list[str]) -> None:
        nonlocal peak
        peak = max(peak, total)
        if log:
            steps.append((step, "; ".join(actions) or "-", total))

    for j in range(L):
        actions = []
        if j >= 1 and j - 1 in release_at:
            start = max(copies, compute)
            copies = copy_done[j - 1] = start + moved[j - 1] / d2h_bytes_per_s
            actions.append(f"start offload {j - 1}")
        if j in released_at:
            i = released_at[j]
            wait_for(copy_done[i])
            hold(i, saved[i] - moved[i])
            actions.append(f"release {i}")
        compute += each[j].forward_s
        hold(j, saved[j])
        note(f"fwd {j}", actions)
    end_of_forward = total
    recompute = 0.0
    for j in reversed(range(L)):
        actions = []
        if j + 1 < L:
            hold(j + 1, 0)
            actions.append(f"release {j + 1}")
        if j in reloaded_at:
            i = reloaded_at[j]
            start = max(copies, compute)
            copies = reload_done[i] = start + moved[i] / h2d_bytes_per_s
            hold(i, resident[i] + moved[i])
            actions.append(f"start reload {i}")
        if j in release_at:
            wait_for(reload_done[j])
        if policy[j] in CHECKPOINTED:
            compute += each[j].forward_s
            recompute += each[j].forward_s
            hold(j, each[j].saved_bytes)
            actions.append(f"recompute {j}")
        compute += each[j].backward_s
        note(f"bwd {j}", actions)
    hold(0, 0)
    note("end", ["release 0"])
    baseline = sum(c.forward_s + c.backward_s for c in each)
    return PlanRow(
        k=m,
        end_of_forward_bytes=end_of_forward,
        peak_bytes=peak,
        offloaded_bytes=sum(moved[j] for j in offloaded),
        exposed_copy_s=waited,
        step_s=compute,  # the compute stream's clock, without rounding
        overhead=(waited + recompute) / baseline if baseline > 0 else 0.0,
        log=steps,
        recompute_s=recompute,
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
    """

    layer: LayerProfile
    device: DeviceProfile
    num_layers: int
    rows: list[PlanRow]
    overhead_budget: float
    memory_budget: int | None
    policy: PolicyPlan | None = None

    @property
    def largest_hidden_k(self) -> int:
        """The largest k whose predicted overhead stays within the budget."""
        return max(row.k for row in self.rows if row.overhead <= self.overhead_budget)

    @property
    def smallest_fitting_k(self) -> int | None:
        """The smallest k whose peak activation memory fits the budget (None: none fits,
        or no budget was given)."""
        if self.memory_budget is None:
            return None
        fitting = [row.k for row in self.rows if row.peak_bytes <= self.memory_budget]
        return min(fitting) if fitting else None

    @property
    def needs_checkpointing(self) -> bool:
        """A memory budget was given and not even k = L - 1 meets it: offloading alone
        cannot fit; recompute (activation checkpointing) some layers."""
        return self.memory_budget is not None and self.smallest_fitting_k is None


def plan_offload(
    layer: LayerProfile,
    num_layers: int,
    device: str | DeviceProfile = "h100",
    *,
    overhead_budget: float = 0.02,
    memory_budget: int | None = None,
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
        simulate_policy(_first_k(num_layers, k), costs, profile.d2h, profile.h2d)
        for k in range(num_layers)
    ]
    policy = None
    if memory_budget is not None:
        from .policy_search import choose_policy  # it runs this module's model

        policy = choose_policy(layer, num_layers, profile, memory_budget=memory_budget)
    return Plan(layer, profile, num_layers, rows, overhead_budget, memory_budget, policy)
