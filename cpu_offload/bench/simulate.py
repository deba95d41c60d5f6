"""``--simulate PROFILE``: the benchmark's stack through the real offload code on a modeled
accelerator (``cpu_offload.testing.timed_runtime``), beside the planner's prediction.

Every k from 0 to L - 1, and with ``--memory-budget`` the policy the planner chooses for
each budget, runs one training step of the preset's Llama stack under ``offload_layers``
on the modeled device, shapes only: the step time, exposed copy time and memory come from
the model's clocks and allocator count.  The planner predicts the same step from its
census of one layer and its event model (``cpu_offload.plan``).  Neither reads the
other: the agreement of the two is the check.

Memory is compared where both count the same thing: device memory at each layer
boundary (after a layer's forward; as backward reaches a layer, after the offloader's
releases and reloads there), less what the planner leaves out by design: the hidden
state handed from layer to layer (or its gradient), the stack's output, and the
parameters' gradients.  The model's allocator peak, temporaries and gradients included,
is reported beside it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..layer_hooks import offload_layers
from ..models import DTYPES
from ..models.llama import LlamaConfig, LlamaLayer
from ..plan.census import LayerProfile, measure_layer
from ..plan.planner import plan_offload
from ..plan.policy_search import choose_policy
from ..plan.schedule_model import PlanRow
from ..report.policy_words import policy_runs
from ..testing import TimedReport, timed_runtime
from .config import BenchConfig

__all__ = ["SimulatedRow", "Simulation", "modeled_step", "run_simulation"]

GIB = 2**30


@dataclass
class SimulatedRow:
    """One k, or one budget's policy: the model's figures and the planner's.

    Attributes:
        label: ``"k=3"``, or ``"20 GiB: 9 O, 13 C, 10 K"`` (the policy as runs of layers).
        k: layers offloaded.
        policy: the per-layer policy, for a budget's row (None for a k's).
        modeled: the modeled run.
        predicted: the planner's row for the same inputs.
    """

    label: str
    k: int
    policy: list[str] | None
    modeled: TimedReport
    predicted: PlanRow

    @property
    def modeled_peak_bytes(self) -> int:
        return self.modeled.counted_peak_bytes

    def modeled_end_of_forward_bytes(self, layers: int) -> int:
        return self.modeled.counted_at(f"forward {layers - 1}")

    def as_json(self, layers: int, baseline_step_s: float) -> dict[str, Any]:
        """The row of the JSON's ``"simulated"`` list."""
        modeled, predicted = self.modeled, self.predicted
        return {
            "k": self.k,
            "policy": self.policy,
            "label": self.label,
            "modeled_step_s": modeled.step_s,
            "predicted_step_s": predicted.step_s,
            "modeled_peak_bytes": self.modeled_peak_bytes,
            "predicted_peak_bytes": predicted.peak_bytes,
            "modeled_exposed_copy_s": modeled.exposed_copy_s,
            "predicted_exposed_copy_s": predicted.exposed_copy_s,
            "modeled_end_of_forward_bytes": self.modeled_end_of_forward_bytes(layers),
            "predicted_end_of_forward_bytes": predicted.end_of_forward_bytes,
            "modeled_overhead": modeled.step_s / baseline_step_s - 1,
            "predicted_overhead": predicted.overhead,
            "modeled_device_peak_bytes": modeled.peak_bytes,
            "modeled_compute_s": modeled.compute_s,
            "modeled_host_bound_s": modeled.host_bound_s,
            "modeled_host_syncs": modeled.host_syncs,
            "modeled_d2h_bytes": modeled.d2h_bytes,
            "modeled_h2d_bytes": modeled.h2d_bytes,
        }


@dataclass
class Simulation:
    """Every row of a ``--simulate`` run, and what they were run on."""

    profile_name: str
    layer: LayerProfile
    layers: int
    rows: list[SimulatedRow]

    @property
    def baseline(self) -> SimulatedRow:
        """The row without offload (k = 0)."""
        return next(row for row in self.rows if row.k == 0 and row.policy is None)


def stack_of(config: BenchConfig) -> tuple[torch.nn.ModuleList, torch.Tensor, LayerProfile]:
    """The preset's layers and input on the meta device, and the planner's census of one
    layer (as a GPU runs it: flash attention, fused dropout)."""
    dtype = DTYPES[config.dtype]
    shape = LlamaConfig(config.hidden, config.heads, config.kv_heads, config.ffn, config.layers)
    with torch.device("meta"):
        layers = torch.nn.ModuleList(LlamaLayer(shape) for _ in range(config.layers)).to(dtype)
    x = torch.empty(config.batch, config.seq, config.hidden, device="meta", dtype=dtype)
    layer = measure_layer(
        lambda: LlamaLayer(shape).to(dtype),
        x,
        min_offload_numel=config.min_offload_numel,
        attention="flash",
    )
    return layers, x.requires_grad_(), layer


def modeled_step(
    layers: torch.nn.ModuleList,
    x: torch.Tensor,
    profile: Any,
    *,
    k: int = 0,
    policy: Sequence[str] | None = None,
    min_offload_numel: int,
    record: bool = True,
    reload_slice_bytes: int | None = None,
    reload_on_demand_layers: Sequence[int] = (),
) -> TimedReport:
    """One forward and backward of ``layers`` under ``offload_layers`` (``k``, or
    ``policy``; offloaded layers reloaded in slices of ``reload_slice_bytes``, those of
    ``reload_on_demand_layers`` without prefetch) on the modeled ``profile``, with a
    memory mark at each layer boundary."""
    params = list(layers.parameters())
    for tensor in [x, *params]:
        tensor.grad = None
    with timed_runtime(profile, record=record) as run, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k = L - 1, checkpoint hazards: measured anyway
        options: dict[str, Any] = {"min_offload_numel": min_offload_numel}
        if reload_slice_bytes is not None:
            options["reload_slice_bytes"] = reload_slice_bytes
        if reload_on_demand_layers:
            options["reload_on_demand_layers"] = list(reload_on_demand_layers)
        if policy is not None:
            handle = offload_layers(layers, policy=list(policy), **options)
        else:
            handle = offload_layers(layers, k, **options)
        try:
            output: list[torch.Tensor] = []

            def reached(index: int) -> Any:
                def hook(grad_outputs: tuple[torch.Tensor, ...]) -> None:
                    run.begin(f"backward {index}")
                    grads = [p.grad for p in params if p.grad is not None]
                    run.mark(f"backward {index}", [*grad_outputs, *output, *grads])

                return hook

            h = x.clone()  # the stack's input, as an embedding makes it: counted
            for index, layer in enumerate(layers):
                run.begin(f"forward {index}")
                h = layer(h)
                run.mark(f"forward {index}", [h])
                h.grad_fn.register_prehook(reached(index))  # after the offloader's
            output.append(h)
            run.begin("loss")
            h.float().square().mean().backward()
        finally:
            handle.remove()
    return run


def run_simulation(
    config: BenchConfig,
    profile_name: str,
    ks: Sequence[int],
    budgets_gib: Sequence[float] = (),
    progress: Any = None,
) -> Simulation:
    """Model and predict every k of ``ks`` and the policy of each budget."""
    layers, x, layer = stack_of(config)
    L = config.layers
    plan = plan_offload(layer, L, profile_name)
    numel = config.min_offload_numel
    rows = []
    for k in ks:
        modeled = modeled_step(layers, x, plan.device, k=k, min_offload_numel=numel)
        rows.append(SimulatedRow(f"k={k}", k, None, modeled, plan.rows[k]))
        if progress is not None:
            progress(rows[-1])
    for budget in budgets_gib:
        chosen = choose_policy(layer, L, plan.device, memory_budget=int(budget * GIB))
        modeled = modeled_step(
            layers, x, plan.device, policy=chosen.policy, min_offload_numel=numel
        )
        runs = ", ".join(
            f"{last - first + 1} {''.join(w[0].upper() for w in choice.split('+'))}"
            for first, last, choice in policy_runs(chosen.policy)
        )
        label = f"{budget:g} GiB: {runs}" + ("" if chosen.fits else " (closest)")
        k = chosen.predicted.offloaded_layers
        rows.append(SimulatedRow(label, k, chosen.policy, modeled, chosen.predicted))
        if progress is not None:
            progress(rows[-1])
    return Simulation(plan.device.name, layer, L, rows)
