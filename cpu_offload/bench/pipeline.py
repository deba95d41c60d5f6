"""``--simulate PROFILE --pipeline-stages P --microbatches M``: each pipeline stage's own
order of forwards and backwards through the real offload code on a modeled accelerator,
beside the planner's stage model (``cpu_offload.plan.pipeline``).

NOTE [A pipeline stage on the modeled accelerator]
    One process models one stage (rank) at a time: its stages' layers (one stack per stage
    of the rank, each under its own ``offload_layers`` with the policy the planner chose
    for the rank) run the rank's order of actions from torch's schedule.  A forward starts
    a pass on a fresh input (the activation received from the previous stage); a
    backward runs the pass's output's backward.  The neighbours' sends and receives are
    waits of the compute stream until the input's arrival in the schedule without offload
    (``plan.pipeline.arrivals``), the times the planner uses: the neighbours do not slow
    down with this stage.  Those waits are not copies: the exposed copy time leaves them
    out.  Memory is counted at every layer boundary as ``--simulate`` counts it (the
    passes' outputs, the hidden state handed on and gradients left out).  ZB-V's split
    backward runs through torch's own functions: ``I`` is ``stage_backward_input``, ``W``
    ``stage_backward_weight``; ``W`` is marked before each node it starts from (where the
    weights' paths meet the inputs'), and the gradients ``I`` leaves there for ``W`` are
    gradients, left out.  The part of a backward ``W`` takes is measured on the same
    device, from one pass of a stage without offload (:func:`weight_share`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_input,
    stage_backward_weight,
)

from ..device.profiles import get_profile
from ..layer_hooks import offload_layers
from ..plan.census import LayerProfile
from ..plan.pipeline import (
    Action,
    PipelinePlan,
    StagePlan,
    arrivals,
    gradient_accumulation_s,
    plan_pipeline,
    rank_orders,
)
from ..plan.schedule_model import LayerCosts
from ..testing import TimedReport, timed_runtime
from .config import BenchConfig
from .simulate import stack_of

__all__ = ["ModeledStage", "PipelineSimulation", "modeled_stage", "run_pipeline"]

GIB = 2**30


@dataclass
class ModeledStage:
    """One stage's modeled run and the planner's prediction of it.

    Attributes:
        plan: the planner's plan of the stage (its policy and prediction).
        modeled: the modeled run.
        input_waited_s: time its compute stream waited for its inputs (the neighbours).
    """

    plan: StagePlan
    modeled: TimedReport
    input_waited_s: float

    @property
    def exposed_copy_s(self) -> float:
        """Time the compute stream waited for copies (the neighbours' waits left out)."""
        return self.modeled.exposed_copy_s - self.input_waited_s

    def as_json(self) -> dict[str, Any]:
        """The entry of the JSON's ``"pipeline"`` list."""
        predicted = self.plan.predicted
        return {
            "stage": self.plan.stage,
            "in_flight": self.plan.in_flight,
            "policy": self.plan.policy.words(self.plan.layers, self.plan.in_flight),
            "keep_passes": self.plan.policy.keep_passes,
            "modeled_step_s": self.modeled.step_s,
            "predicted_step_s": predicted.step_s,
            "modeled_peak_bytes": self.modeled.counted_peak_bytes,
            "predicted_peak_bytes": predicted.peak_bytes,
            "modeled_exposed_copy_s": self.exposed_copy_s,
            "predicted_exposed_copy_s": predicted.exposed_copy_s,
            "modeled_input_waited_s": self.input_waited_s,
            "modeled_d2h_bytes": self.modeled.d2h_bytes,
            "predicted_offloaded_bytes": predicted.offloaded_bytes,
            "modeled_device_peak_bytes": self.modeled.peak_bytes,
        }


@dataclass
class PipelineSimulation:
    """Every stage of a modeled pipeline, and what they ran."""

    profile_name: str
    layer: LayerProfile
    plan: PipelinePlan
    stages: list[ModeledStage]

    def worst(self) -> dict[str, Any]:
        """The worst step and peak differences over the stages, and where."""
        found: dict[str, Any] = {}
        for key, pair in (
            ("step", lambda s: (s.modeled.step_s, s.plan.predicted.step_s)),
            ("peak", lambda s: (s.modeled.counted_peak_bytes, s.plan.predicted.peak_bytes)),
        ):
            stage = max(self.stages, key=lambda s: abs(_difference(*pair(s))))
            found[f"worst_{key}_difference"] = _difference(*pair(stage))
            found[f"worst_{key}_stage"] = stage.plan.stage
        return found


def _difference(modeled: float, predicted: float) -> float:
    if predicted == 0:
        return 0.0 if modeled == 0 else float("inf")
    return modeled / predicted - 1


def modeled_stage(
    chunks: Sequence[torch.nn.ModuleList],
    x: torch.Tensor,
    profile: Any,
    order: Sequence[Action],
    ready: Sequence[float],
    *,
    k: int,
    keep_passes: int | None,
    min_offload_numel: int,
    record: bool = True,
) -> tuple[TimedReport, float]:
    """One rank's ``order`` of actions on the modeled ``profile`` (NOTE [A pipeline stage
    on the modeled accelerator]); returns the run and its time waiting for inputs."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    for tensor in [x, *params]:
        tensor.grad = None
    options: dict[str, Any] = {"min_offload_numel": min_offload_numel}
    if keep_passes is not None:
        options["keep_passes"] = keep_passes
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    held: dict[tuple[int, int], list[torch.Tensor]] = {}  # I's gradients for W
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    waited = 0.0
    with timed_runtime(profile, record=record) as run, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k = L - 1: measured anyway
        runtime: Any = run.live
        handles = [offload_layers(chunk, k, **options) for chunk in chunks]
        try:
            for action, arrival in zip(order, ready, strict=True):
                clock = runtime.compute.clock
                waited += max(0.0, arrival - runtime.timeline.now(clock))
                runtime.timeline.wait(clock, arrival, "input from a neighbour")
                name = f"{action.kind}{action.microbatch} stage {action.stage}"
                run.begin(name)
                key = (action.chunk, action.microbatch)
                chunk = chunks[action.chunk]
                if action.kind == "F":
                    grads = [x, *params]  # the input's gradient: sent to the previous stage
                    outputs[key] = _forward(run, chunk, x, name, outputs, grads, held)
                elif action.kind == "B":
                    outputs.pop(key).float().square().mean().backward()
                elif action.kind == "I":
                    groups[key] = _input_gradients(outputs.pop(key), x, chunk, key, held)
                else:
                    group, waiting = groups.pop(key), list(outputs.values())
                    _weight_gradients(run, chunk, group, name, [x, *params], waiting, held)
                    del waiting  # the outputs live as long as their passes, not longer
                    del held[key]
        finally:
            for handle in handles:
                handle.remove()
    return run, waited


def _forward(
    run: TimedReport,
    layers: torch.nn.ModuleList,
    x: torch.Tensor,
    name: str,
    outputs: dict[tuple[int, int], torch.Tensor],
    params: list[torch.Tensor],
    held: dict[tuple[int, int], list[torch.Tensor]],
) -> torch.Tensor:
    """One pass's forward with a memory mark at each layer boundary."""

    def reached(label: str) -> Callable[[tuple[torch.Tensor, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor, ...]) -> None:
            left_out = [*grad_outputs, *outputs.values(), *_gradients(params, held)]
            run.mark(label, left_out)

        return hook

    h = x.clone()  # the activation received from the previous stage: counted
    for index, layer in enumerate(layers):
        h = layer(h)
        run.mark(f"{name} forward {index}", [h, *outputs.values(), *_gradients(params, held)])
        h.grad_fn.register_prehook(reached(f"{name} backward {index}"))
    return h


def _gradients(
    params: list[torch.Tensor], held: dict[tuple[int, int], list[torch.Tensor]]
) -> list[torch.Tensor]:
    """The gradients a mark leaves out: the parameters' and those ``I`` left for ``W``."""
    return [
        *(p.grad for p in params if p.grad is not None),
        *(t for tensors in held.values() for t in tensors),
    ]


def _input_gradients(
    out: torch.Tensor,
    x: torch.Tensor,
    layers: torch.nn.Module,
    key: tuple[int, int],
    held: dict[tuple[int, int], list[torch.Tensor]],
) -> list[dict[str, Any]]:
    """ZB-V's ``I`` of one pass (torch's ``stage_backward_input``, from the gradient of
    its output as the next stage sends it); ``held[key]`` gets the gradients it leaves
    for ``W`` as it goes (at the nodes where the weights' paths meet the inputs', found as
    torch finds them), and while it runs the output and its gradient (left out)."""
    nodes_of: Any = _get_grad_fn_or_grad_acc
    weights = [nodes_of(p) for p in layers.parameters()]
    reverse = construct_reverse_graph([nodes_of(out)])
    found = get_param_groups([nodes_of(x)], weights, reverse)
    nodes = {node for group in found for node in group["intermediates"]}
    grad = torch.ones_like(out)  # the gradient received from the next stage
    kept = held[key] = [out, grad]

    def keep(grad_inputs: tuple[torch.Tensor | None, ...]) -> None:
        kept.extend(g for g in grad_inputs if g is not None)

    handles = [node.register_prehook(keep) for node in nodes]
    try:
        return stage_backward_input([out], [grad], [x], layers.parameters())[1]
    finally:
        for handle in handles:
            handle.remove()
        del kept[:2]


def _weight_gradients(
    run: TimedReport,
    layers: torch.nn.Module,
    groups: list[dict[str, Any]],
    name: str,
    params: list[torch.Tensor],
    outputs: list[torch.Tensor],
    held: dict[tuple[int, int], list[torch.Tensor]],
) -> None:
    """ZB-V's ``W`` of one pass (torch's ``stage_backward_weight``), with a memory mark
    before each node it starts from; left out: the gradients of ``params`` (the input
    and the parameters), the ``outputs`` of the passes waiting, and ``held``."""

    def reached(label: str) -> Callable[[tuple[torch.Tensor, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor, ...]) -> None:
            run.mark(label, [*grad_outputs, *outputs, *_gradients(params, held)])

        return hook

    nodes = [node for group in groups for node in group["intermediates"]]
    handles = [node.register_prehook(reached(f"{name} {i}")) for i, node in enumerate(nodes)]
    try:  # a group at a time, as torch runs them (its loop holds a group's weight
        for group in groups:  # gradients into the next group's: gradients, left out)
            stage_backward_weight(layers.parameters(), [group])
    finally:
        for handle in handles:
            handle.remove()


def weight_share(layers: torch.nn.ModuleList, x: torch.Tensor, profile: Any) -> float:
    """The part of a backward of ``layers`` that ZB-V's ``W`` (weight gradients) runs on
    the modeled ``profile``, from one pass without offload."""
    with timed_runtime(profile, record=False) as run:
        runtime: Any = run.live

        def now() -> float:
            return float(runtime.timeline.now(runtime.compute.clock))

        h = x.clone()
        for layer in layers:
            h = layer(h)
        loss = h.float().square().mean()
        start = now()
        groups = stage_backward_input([loss], None, [x], layers.parameters())[1]
        middle = now()
        stage_backward_weight(layers.parameters(), groups)
        end = now()
    for p in [x, *layers.parameters()]:
        p.grad = None
    return (end - middle) / (end - start) if end > start else 0.5


def run_pipeline(
    config: BenchConfig,
    profile_name: str,
    progress: Callable[[ModeledStage], None] | None = None,
    record: bool = True,
) -> PipelineSimulation:
    """Plan every stage of the preset's pipeline and run each on the modeled device."""
    schedule, ranks = str(config.schedule), int(config.pipeline_stages or 0)
    microbatches = int(config.microbatches or 0)
    per_rank = {"interleaved": config.virtual_stages or 2, "zbv": 2}.get(schedule, 1)
    per_stage = config.layers // (ranks * per_rank)
    stage_config = BenchConfig(**{**config.__dict__, "layers": per_stage})
    layers, x, layer = stack_of(stage_config)
    budget = config.memory_budget[0] if config.memory_budget else None
    device = get_profile(profile_name)
    costs = LayerCosts.of(layer, device)
    accumulate_s = gradient_accumulation_s(layers, device)
    share = weight_share(layers, x, device) if schedule == "zbv" else 0.5
    plan = plan_pipeline(
        costs, config.layers, device.d2h, device.h2d, ranks=ranks, microbatches=microbatches,
        schedule=schedule, virtual_stages=per_rank,
        memory_budget=None if budget is None else int(budget * GIB),
        accumulate_s=accumulate_s, weight_share=share,
    )  # fmt: skip
    orders = rank_orders(schedule, ranks, microbatches, per_rank)
    each = costs.per_layer(per_stage)
    forward_s, backward_s = sum(c.forward_s for c in each), sum(c.backward_s for c in each)
    ready = arrivals(orders, forward_s, backward_s, accumulate_s, share)
    chunks = [layers] + [stack_of(stage_config)[0] for _ in range(per_rank - 1)]
    stages = []
    for stage in plan.stages:
        modeled, waited = modeled_stage(
            chunks, x, device, orders[stage.stage], ready[stage.stage], k=stage.policy.k,
            keep_passes=stage.policy.keep_passes, min_offload_numel=config.min_offload_numel,
            record=record,
        )  # fmt: skip
        stages.append(ModeledStage(stage, modeled, waited))
        if progress is not None:
            progress(stages[-1])
    return PipelineSimulation(device.name, layer, plan, stages)


def print_pipeline(simulation: PipelineSimulation) -> None:
    """The stages' table: modeled beside predicted."""
    plan = simulation.plan
    print(
        f"pipeline: {plan.schedule}, {plan.ranks} ranks x {plan.virtual_stages} stage(s) of "
        f"{plan.layers_per_stage} layers, {plan.microbatches} micro-batches; each rank's "
        "order through the offload code (modeled) beside the stage model (predicted)"
    )
    header = (
        f"{'stage':>5} {'in flight':>9}  {'policy':<66} {'step ms model':>13} {'plan':>8} "
        f"{'diff':>7} {'peak GiB':>8} {'plan':>6} {'diff':>7} {'exposed ms':>10} {'plan':>7}"
    )
    print(header)
    print("-" * len(header))
    for stage in simulation.stages:
        m, p = stage.modeled, stage.plan.predicted
        peak = m.counted_peak_bytes
        words = stage.plan.policy.words(stage.plan.layers, stage.plan.in_flight)
        print(
            f"{stage.plan.stage:>5} {stage.plan.in_flight:>9}  "
            f"{words:<66} {m.step_s * 1e3:>13.1f} "
            f"{p.step_s * 1e3:>8.1f} {_difference(m.step_s, p.step_s):>+7.2%} "
            f"{peak / GIB:>8.3f} {p.peak_bytes / GIB:>6.3f} "
            f"{_difference(peak, p.peak_bytes):>+7.2%} {stage.exposed_copy_s * 1e3:>10.1f} "
            f"{p.exposed_copy_s * 1e3:>7.1f}"
        )
    worst = simulation.worst()
    print(
        f"agreement over {len(simulation.stages)} stages: step within "
        f"{abs(worst['worst_step_difference']):.2%} (stage {worst['worst_step_stage']}), peak "
        f"within {abs(worst['worst_peak_difference']):.2%} (stage {worst['worst_peak_stage']})"
    )
