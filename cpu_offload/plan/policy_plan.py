"""What the policy search answers: the policy chosen for a memory budget, its predicted
cost, and the table it prints as."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..policy.memory_budget import size
from ..policy.policy import (
    CHECKPOINT,
    CHECKPOINT_OFFLOAD,
    KEEP,
    OFFLOAD,
)
from ..report.policy_words import describe_policy, pass_policy_words, policy_runs
from .schedule_model import LayerCosts, PlanRow

__all__ = ["PolicyPlan", "size"]

#: choices by code, for tables
_SHORT = {
    KEEP: "keep",
    OFFLOAD: "offload",
    CHECKPOINT: "checkpoint",
    CHECKPOINT_OFFLOAD: "ckpt+offload",
}


@dataclass
class PolicyPlan:
    """The policy chosen for a memory budget, and what it is predicted to cost.

    ``str(plan)`` is a table: one row per layer (its choice; ``activations``: the memory
    its saved activations hold, each storage once, parameters left out; ``copied``: the
    bytes its choice copies to the host per step, what a step report's ``copied_bytes``
    and ``stats.bytes_offloaded`` count; ``inputs``: what it keeps when checkpointed),
    then the prediction.

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
        checkpoint_refused: why layers were not checkpointed (their
            ``checkpoint_hazards``); empty when checkpointing was among every layer's
            choices.
        layer_costs: the costs of each layer the plan was made from.
        layer_names: what each layer is (its class), for the table.
        why: when nothing fits, why not.
        host_cap: the host cap the plan was made under (``max_host_bytes``), or None.
        host_bytes: what the policy holds in host memory, with the pool's reserve.
        binding: when nothing fits, the limit that binds: ``"memory_budget"`` or
            ``"max_host_bytes"`` (a policy fits the device but not the host); else "".
        in_flight: the forward passes in flight the plan was made for (a pipeline
            stage's; NOTE [A budget inside a stage] in stage_plan.py); 1 elsewhere.
        keep_passes: of those, how many keep ``policy``, the others moved whole; None:
            every pass keeps it.  Pass both to ``offload_layers``.
        reload_slice_bytes: offloaded layers reloaded in slices of this many bytes
            (NOTE [Reloading a layer in slices] in engine/reload_slices.py); None: whole.
            Pass it to ``offload_layers``.
        reload_on_demand_layers: of those, the layers whose slices come back as
            backward first takes from them, without prefetch (NOTE [Slices at the peak]
            in engine/reload_slices.py).  Pass it to ``offload_layers``.
    """

    policy: list[str]
    fits: bool
    predicted: PlanRow
    memory_budget: int
    candidates: int
    checkpoint_refused: list[str] = field(default_factory=list)
    layer_costs: list[LayerCosts] = field(default_factory=list, repr=False)
    layer_names: list[str] = field(default_factory=list, repr=False)
    why: str = ""
    host_cap: int | None = None
    host_bytes: int = 0
    binding: str = ""
    in_flight: int = 1
    keep_passes: int | None = None
    reload_slice_bytes: int | None = None
    reload_on_demand_layers: tuple[int, ...] = ()

    def blocks(self) -> list[tuple[int, int, str]]:
        """``(first layer, last layer, choice)`` for each run of equal choices."""
        return policy_runs(self.policy)

    def runs(self) -> str:
        """The policy as runs of layers: ``"0-5 offload, 6-7 checkpoint, 8-31 keep"``, and
        with passes in flight what each does: ``"...; keep 1 pass, 3 of 4 moved whole"``."""
        runs = describe_policy(self.policy)
        if self.reload_slice_bytes is not None:
            runs += f" (reloaded in slices of {size(self.reload_slice_bytes)}"
            on_demand = self.reload_on_demand_layers
            runs += f", layer {', '.join(map(str, on_demand))} on demand)" if on_demand else ")"
        if self.in_flight <= 1:
            return runs
        if self.keep_passes is None:
            return f"{runs}; every pass of {self.in_flight} in flight"
        return f"{runs}; {pass_policy_words(self.keep_passes, self.in_flight)}"

    def line(self) -> str:
        """One line: the runs, the predicted peak against the budget, the overhead."""
        row = self.predicted
        return (
            f"{self.runs()}; predicted peak {size(row.peak_bytes)} of "
            f"{size(self.memory_budget)}{'' if self.fits else ' (NOTHING FITS: the closest)'}"
            f"{self._host()}, predicted overhead {row.overhead:+.1%}"
        )

    def _host(self) -> str:
        if self.host_cap is None:
            return ""
        return f", host {size(self.host_bytes)} of {size(self.host_cap)}"

    def __str__(self) -> str:
        row = self.predicted
        lines = [
            f"PolicyPlan for {size(self.memory_budget)} of saved activations{self._host()}: "
            + ("fits" if self.fits else "NOTHING FITS (the closest)")
            + f", the best of {self.candidates} policies",
            f"{'layer':>5}  {'module':<24} {'choice':<12} {'activations':>11} {'copied':>11} "
            f"{'inputs':>11}",
        ]
        for index, choice in enumerate(self.policy):
            name = self.layer_names[index] if index < len(self.layer_names) else ""
            cost = self.layer_costs[index] if index < len(self.layer_costs) else None
            copied = 0
            if cost is not None and choice == OFFLOAD:
                copied = cost.offloaded_bytes
            elif cost is not None and choice == CHECKPOINT_OFFLOAD:
                copied = cost.input_offloaded_bytes
            saved, inputs = (cost.saved_bytes, cost.input_bytes) if cost else (0, 0)
            lines.append(
                f"{index:>5}  {name[:24]:<24} {_SHORT[choice]:<12} {size(saved):>11} "
                f"{size(copied):>11} {size(inputs):>11}"
            )
        lines.append(
            f"predicted: peak {size(row.peak_bytes)}, end of forward "
            f"{size(row.end_of_forward_bytes)}, {size(row.offloaded_bytes)} copied per step, "
            f"step {row.step_s * 1e3:.3f} ms ({row.overhead:+.1%}: {row.recompute_s * 1e3:.3f} "
            f"ms recompute, {row.exposed_copy_s * 1e3:.3f} ms waiting for copies)"
        )
        if self.why:
            lines.append(self.why)
        lines += [f"checkpointing refused: {hazard}" for hazard in self.checkpoint_refused]
        return "\n".join(lines)
