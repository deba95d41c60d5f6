"""What the command prints: the table of every k and its answers, the policy for a
budget, the saved bytes per submodule, and the table of a pipeline's stages."""

from __future__ import annotations

from ...hooks.selection import KEPT_BY_MODULES
from ..census import LayerProfile
from ..node import Node
from ..pipeline.search import PipelinePlan
from ..planner import Plan
from ..policy_search import PolicyPlan
from ..schedule_model import PlanRow

__all__ = [
    "answer_bytes",
    "budget_text",
    "host_bytes_per_rank",
    "print_answers",
    "print_plan",
    "print_policy",
    "print_saved_by",
    "print_stages",
]

GIB = 2**30


def print_plan(plan: Plan, description: str, node: Node | None = None) -> None:
    node = node or Node()
    layer, device = plan.layer, plan.device
    print(f"layer: {description}")
    print(
        f"  saves {layer.saved_bytes / GIB:.3f} GiB, offloads {layer.offloaded_bytes / GIB:.3f} "
        f"GiB ({layer.tensors_offloaded} copies), keeps {layer.kept_bytes / GIB:.3f} GiB "
        f"{dict(layer.kept_by_reason)}; attention measured as {layer.attention!r}"
    )
    if layer.following is not None:
        later = layer.following
        print(
            f"  layers 1 to L-1 (their input is the previous layer's output, laid out "
            f"otherwise): save {later.saved_bytes / GIB:.3f} GiB, offload "
            f"{later.offloaded_bytes / GIB:.3f} GiB ({later.tensors_offloaded} copies), "
            f"{later.input_offloaded_bytes / GIB:.3f} GiB when checkpointed and offloaded"
        )
    if layer.unpredictable:
        print(f"  NOT PREDICTED: {layer.unpredictable}")
    print(
        f"  {layer.forward_flops / 1e12:.2f} TFLOP forward, {layer.backward_flops / 1e12:.2f} "
        "TFLOP backward"
    )
    print(f"device: {device.name} ({device.source})")
    print(f"L = {plan.num_layers}; times are PREDICTED by the schedule model")
    if plan.cuda_graph:
        print(
            "captured: each step replays one CUDA graph (--cuda-graph): no host issue time "
            f"in the step (a replay's launch: {plan.graph_launch_s * 1e6:.0f} us of host, "
            "before the device starts); peak GiB stays held in the graph's pool and host "
            "GiB/rank stays pinned, for the graph's life"
        )
    print(
        f"{'k':>3} {'offloaded/step GiB':>18} {'end of fwd GiB':>14} {'peak GiB':>9} "
        f"{'exposed ms':>10} {'step ms':>9} {'overhead':>9} {'host GiB/rank':>13} "
        f"{'host GiB/node':>13}"
    )
    for row in plan.rows:
        print(
            f"{row.k:>3} {row.offloaded_bytes / GIB:>18.3f} "
            f"{row.end_of_forward_bytes / GIB:>14.3f} {row.peak_bytes / GIB:>9.3f} "
            f"{row.exposed_copy_s * 1e3:>10.3f} "
            f"{row.step_s * 1e3:>9.3f} {row.overhead:>9.2%} "
            f"{host_bytes_per_rank(row) / GIB:>13.3f} "
            f"{node.per_node(row.offloaded_bytes) / GIB:>13.3f}"
        )
    print(
        "host GiB/rank: host memory (pinned on a GPU) one rank needs per micro-batch in "
        "flight, with the pool's reserve; per node: times --ranks-per-node "
        f"{node.ranks}; cap it with max_host_bytes ('auto': the rank's share of the node)"
    )
    print_answers(plan)
    if plan.policy is not None:
        print_policy(plan.policy)
    print(node.describe(answer_bytes(plan)))


def print_answers(plan: Plan) -> None:
    """The largest k within the overhead budget and the smallest k that fits the memory
    budget, both among the k whose host memory fits the cap per rank (where one is
    given); where the cap changes an answer, what it would be without the cap."""
    free = plan.uncapped()
    host = (
        ""
        if plan.host_cap is None
        else f" and {plan.host_cap / GIB:.2f} GiB of host memory per rank"
    )
    hidden, unbound = plan.largest_hidden_k, free.largest_hidden_k
    line = f"largest k within {plan.overhead_budget:.1%} overhead{host}: {hidden}"
    if unbound != hidden:
        need = host_bytes_per_rank(plan.rows[unbound]) / GIB
        line += f" (the host binds: k = {unbound} needs {need:.2f} GiB per rank)"
    print(line)
    if plan.memory_budget is None:
        return
    budget, k = budget_text(plan.memory_budget), free.smallest_fitting_k
    if not plan.needs_checkpointing:
        print(f"smallest k that fits {budget} of activations{host}: {plan.smallest_fitting_k}")
    elif k is None:
        print(f"no k fits {budget} of activations: offloading alone is not enough")
    else:
        need = host_bytes_per_rank(plan.rows[k]) / GIB
        print(
            f"no k fits {budget} of activations{host}: the host binds (k = {k} fits the "
            f"device and needs {need:.2f} GiB per rank); offloading alone is not enough"
        )


def answer_bytes(plan: Plan) -> int:
    """What the plan's answer moves per step: its policy's, else the largest hidden k's."""
    if plan.policy is not None:
        return plan.policy.predicted.offloaded_bytes
    return plan.rows[plan.largest_hidden_k].offloaded_bytes


def budget_text(budget: int) -> str:
    """A budget in GiB, with the digits a small one needs."""
    return f"{budget / GIB:.2f} GiB" if budget >= GIB // 10 else f"{budget / GIB:.4f} GiB"


def print_policy(choice: PolicyPlan) -> None:
    """The chosen policy as a table of runs of layers, and what it is predicted to cost."""
    row = choice.predicted
    budget = budget_text(choice.memory_budget)
    if choice.host_cap is not None:
        budget += f" and {choice.host_cap / GIB:.2f} GiB of host memory per rank"
    if choice.fits:
        print(f"policy for {budget} (the fastest of {choice.candidates} that fits):")
    elif choice.binding == "max_host_bytes":
        print(f"policy for {budget}: NOTHING FITS: the host binds; the closest that fits it:")
    elif choice.checkpoint_refused:
        print(
            f"policy for {budget}: NOTHING FITS without checkpointing (refused below); the "
            f"closest of {choice.candidates} (smallest peak):"
        )
    else:
        print(
            f"policy for {budget}: NOTHING FITS, not even checkpointing every layer and "
            f"offloading its inputs; the closest of {choice.candidates} (smallest peak):"
        )
    print(f"  {'layers':>9}  {'choice':<18}")
    for first, last, what in choice.blocks():
        print(f"  {f'{first}-{last}' if last > first else str(first):>9}  {what:<18}")
    print(
        f"  predicted: end of forward {row.end_of_forward_bytes / GIB:.3f} GiB, peak "
        f"{row.peak_bytes / GIB:.3f} GiB, offloaded {row.offloaded_bytes / GIB:.3f} GiB/step, "
        f"step {row.step_s * 1e3:.3f} ms ({row.overhead:.2%} overhead: "
        f"{row.recompute_s * 1e3:.3f} ms recompute, {row.exposed_copy_s * 1e3:.3f} ms copies)"
    )
    print(f"  apply it: offload_layers(model, policy={choice.policy!r})")
    for hazard in choice.checkpoint_refused:
        print(f"  checkpointing refused: recomputing the layer changes training: {hazard}")


def host_bytes_per_rank(row: PlanRow) -> int:
    """Host memory one rank holds for a micro-batch in flight: what it offloads in a step,
    with the pool's reserve (NOTE [Host memory per node] in node.py)."""
    return Node().per_rank(row.offloaded_bytes)


def print_saved_by(profile: LayerProfile) -> None:
    """One layer's saved bytes by submodule and by kind of operation (MiB)."""
    for title, table in (("submodule", profile.saved_by_module), ("kind", profile.saved_by_kind)):
        cells = ", ".join(f"{name or '(layer)'} {n / 2**20:.0f}" for name, n in table.items())
        print(f"saved per {title} (MiB): {cells}")
    kept = profile.kept_by_reason.get(KEPT_BY_MODULES, 0)
    print(f"modules= keeps {kept / 2**20:.0f} MiB per layer on the device")


def print_stages(plan: PipelinePlan) -> None:
    """One row per stage: the chosen policy, the stage without offload, and today's
    layer-k offload at the same peak."""
    budget = "no budget" if plan.memory_budget is None else budget_text(plan.memory_budget)
    print(
        f"pipeline: {plan.schedule}, {plan.ranks} ranks x {plan.virtual_stages} stage(s) of "
        f"{plan.layers_per_stage} layers, {plan.microbatches} micro-batches; {budget} per "
        "stage; PREDICTED by the stage model (docs/pipeline.md)"
    )
    header = (
        f"{'stage':>5} {'in flight':>9}  {'policy':<66} {'peak GiB':>8} {'step ms':>8} "
        f"{'fits':>4} | {'no offload GiB':>14} {'ms':>7} | {'layer-k':>7} {'GiB':>6} {'ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for stage in plan.stages:
        row, without, today = stage.predicted, stage.without, stage.layer_k
        words = stage.policy.words(stage.layers, stage.in_flight)
        print(
            f"{stage.stage:>5} {stage.in_flight:>9}  {words:<66} "
            f"{row.peak_bytes / GIB:>8.2f} {row.step_s * 1e3:>8.1f} "
            f"{'yes' if stage.fits else 'NO':>4} | {without.peak_bytes / GIB:>14.2f} "
            f"{without.step_s * 1e3:>7.1f} | {'k=' + str(stage.layer_k_policy.k):>7} "
            f"{today.peak_bytes / GIB:>6.2f} {today.step_s * 1e3:>7.1f}"
        )
    print(
        "step ms: when the stage's last backward ends, its inputs arriving as the schedule "
        "without offload times them; layer-k: today's offload of the first k layers of "
        "every pass, the smallest k that reaches the policy's peak (or its smallest peak)"
    )
