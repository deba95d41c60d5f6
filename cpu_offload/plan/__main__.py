"""``python -m cpu_offload.plan``: memory and predicted time of every k, on any machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from ..cli import (
    Parser,
    at_least,
    fraction,
    int_in,
    memory_amount,
    output_file,
    plot_file,
    positive_float,
)
from ..device.profiles import PROFILES, DeviceProfile, get_profile, with_flops
from ..hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL, KEPT_BY_MODULES
from ..models import DTYPES
from ..policy.policy import CHECKPOINT, CHECKPOINT_OFFLOAD, KEEP, OFFLOAD
from .census import ATTENTIONS, LayerProfile, measure_layer
from .layers import LayerSpec, gpt_layer, hf_layer, preset_layer
from .module_search import ModuleSearch
from .node import Node, host_memory_argument
from .pipeline import SCHEDULES, PipelinePlan, gradient_accumulation_s, plan_pipeline, shape_error
from .planner import MAX_LAYERS, Plan, plan_offload
from .policy_search import MAX_SEARCH_LAYERS, PolicyPlan
from .schedule_model import LayerCosts, PlanRow

GIB = 2**30
PLAN_PRESETS = ["tiny", "llama8b-layer", "mixtral8x7b-layer", "tiny-moe"]
GPT_LAYERS = 32  # the stack a --gpt layer is planned in, unless --layers says otherwise


def parser() -> Parser:
    parser = Parser(
        prog="python -m cpu_offload.plan",
        description="Predict activation memory and copy overhead of offloading k layers, "
        "from the model's shapes (measured on the meta device; nothing is allocated). "
        "The layer is --preset llama8b-layer unless --preset, --hf-config or --gpt says "
        "otherwise.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=PLAN_PRESETS,
        default=None,
        help="a preset layer, with its own shapes, seq and batch (default: llama8b-layer: "
        "seq 4096, batch 1, bf16, 8 layers)",
    )
    source.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face model's first decoder layer, from a local config.json (or its "
        "folder) or a model in the local cache (default: --preset; with --hf-config, seq "
        "4096 and batch 1 unless --seq and --batch say otherwise, and the model's layers)",
    )
    source.add_argument(
        "--gpt",
        action="store_true",
        help="a GPT layer (Korthikanti et al.; default: off; seq 2048, batch 1, 32 layers)",
    )
    parser.add_argument(
        "--hidden", type=at_least(1), default=None, help="--gpt only: hidden size (default: 4096)"
    )
    parser.add_argument(
        "--heads", type=at_least(1), default=None, help="--gpt only: attention heads (default: 32)"
    )
    parser.add_argument(
        "--seq",
        type=at_least(1),
        default=None,
        help="tokens per sequence (default: the preset's; 4096 with --hf-config, 2048 with --gpt)",
    )
    parser.add_argument(
        "--batch",
        type=at_least(1),
        default=None,
        help="sequences per micro-batch (default: the preset's; 1 with --hf-config and --gpt)",
    )
    parser.add_argument(
        "--layers",
        type=int_in(2, MAX_LAYERS),
        default=None,
        help=f"L, the layers of the stack, 2..{MAX_LAYERS} (default: the model's; "
        f"{GPT_LAYERS} with --gpt)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="--gpt and --hf-config only (default: bf16; a preset has its own)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="flash",
        help="the attention kernel whose saved tensors are measured (default: flash)",
    )
    parser.add_argument(
        "--device",
        default="h100",
        help=f"the device profile: {', '.join(PROFILES)}, or a JSON file of "
        "python -m cpu_offload.check (default: h100)",
    )
    parser.add_argument(
        "--flops",
        type=positive_float,
        default=None,
        help="FLOP/s to assume instead of the profile's (default: the profile's)",
    )
    parser.add_argument(
        "--min-offload-numel",
        type=at_least(0),
        default=DEFAULT_MIN_OFFLOAD_NUMEL,
        help="tensors with fewer elements stay on the device, as offload_layers' "
        f"min_offload_numel= (default: {DEFAULT_MIN_OFFLOAD_NUMEL})",
    )
    parser.add_argument(
        "--overhead",
        type=fraction,
        default=0.02,
        help="allowed step overhead: a fraction up to 1 or a percentage (default: 0.02, "
        "that is 2%%)",
    )
    parser.add_argument(
        "--memory-budget",
        type=memory_amount("--memory-budget"),
        default=None,
        metavar="GIB",
        help="saved activations allowed: GiB (20, 0.5) or a size with its unit (512MiB); "
        "also choose keep/offload/checkpoint per layer (default: none)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=at_least(1),
        default=1,
        metavar="N",
        help="ranks sharing a node's host memory (default: 1)",
    )
    parser.add_argument(
        "--host-memory",
        type=host_memory_argument,
        default=None,
        metavar="GIB",
        help="GiB of host memory a node gives offloading (or 256GiB, 1TiB): each rank's "
        "share caps what the policy moves and the recommended k (default: none, no cap)",
    )
    parser.add_argument(
        "--modules",
        nargs="+",
        metavar="NAME[=keep|offload]",
        default=None,
        help="offload_layers' modules=: names alone offload those and keep the rest "
        "(default: every module)",
    )
    parser.add_argument(
        "--per-module",
        action="store_true",
        help="with --memory-budget: also try keeping parts of each offloaded layer "
        "(modules=; default: off)",
    )
    pipeline = parser.add_argument_group(
        "pipeline parallelism", "plan every stage of a pipeline schedule (docs/pipeline.md)"
    )
    pipeline.add_argument(
        "--pipeline-stages",
        type=at_least(2),
        default=None,
        metavar="P",
        help="pipeline ranks: the layers split evenly over them; --memory-budget applies to "
        "every stage (default: none, one stack)",
    )
    pipeline.add_argument(
        "--microbatches",
        type=at_least(1),
        default=None,
        metavar="M",
        help="micro-batches per step (with --pipeline-stages, which needs it; no default)",
    )
    pipeline.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        default=None,
        help="the pipeline schedule, torch's order of each rank (default: 1f1b)",
    )
    pipeline.add_argument(
        "--virtual-stages",
        type=at_least(2),
        default=None,
        metavar="V",
        help="--schedule interleaved: stages per rank (default: 2; zbv has 2)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=output_file,
        help="also write the plan as JSON (default: none)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        type=plot_file,
        help="also plot memory and overhead per k (default: none)",
    )
    return parser


def layer_spec(args: argparse.Namespace) -> LayerSpec:
    """The layer to measure (its ``num_layers``: the model's, where known)."""
    dtype = DTYPES[args.dtype]
    if args.hf_config:
        return hf_layer(args.hf_config, args.seq or 4096, args.batch or 1, dtype, args.attention)
    if args.gpt:
        seq, batch = args.seq or 2048, args.batch or 1
        return gpt_layer(seq, batch, args.hidden, args.heads, dtype, args.attention)
    return preset_layer(args.preset or "llama8b-layer", args.seq, args.batch)


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


def to_json(plan: Plan, description: str, node: Node | None = None) -> dict[str, object]:
    node = node or Node()
    layer = dataclasses.asdict(plan.layer)
    for measured in (layer, layer["following"]):
        if measured is not None:  # the long lists stay out: their totals are there
            for key in (
                "saved",
                "forward_kernels",
                "backward_kernels",
                "recompute_kernels",
                "saved_by_module",
                "saved_by_kind",
                "forward_sites",
                "offloaded_unpacks",
            ):
                measured.pop(key)
    return {
        "description": description,
        "layer": layer,
        "device": dataclasses.asdict(plan.device),
        "num_layers": plan.num_layers,
        "predicted": True,
        "rows": [
            {"k": row.k}
            | {
                key: value
                for key, value in dataclasses.asdict(row).items()
                if key not in ("log", "offloaded_layers")
            }
            | node.to_json(row.offloaded_bytes)
            for row in plan.rows
        ],
        "ranks_per_node": node.ranks,
        "host_memory_bytes": node.host_memory,
        **node.to_json(answer_bytes(plan)),
        "largest_hidden_k": plan.largest_hidden_k,
        "overhead_budget": plan.overhead_budget,
        "memory_budget": plan.memory_budget,
        "smallest_fitting_k": plan.smallest_fitting_k,
        "needs_checkpointing": plan.needs_checkpointing,
    } | (policy_json(plan.policy) if plan.policy is not None else {})


def policy_json(choice: PolicyPlan) -> dict[str, object]:
    row = choice.predicted
    return {
        "policy": choice.policy,
        "policy_fits": choice.fits,
        "policy_checkpoint_refused": choice.checkpoint_refused,
        "policy_binding": choice.binding,
        "policy_predicted": {
            "end_of_forward_bytes": row.end_of_forward_bytes,
            "peak_bytes": row.peak_bytes,
            "offloaded_bytes_per_step": row.offloaded_bytes,
            "step_time_s": row.step_s,
            "overhead": row.overhead,
            "recompute_s": row.recompute_s,
            "exposed_copy_s": row.exposed_copy_s,
        },
    }


def write_plot(plan: Plan, path: str) -> str | None:
    """Activation memory and predicted overhead against k; why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    ks = [row.k for row in plan.rows]
    if plan.policy is not None:
        figure, (memory, layers) = plt.subplots(
            2, 1, figsize=(7, 5.5), gridspec_kw={"height_ratios": [3, 1]}
        )
        draw_policy(layers, plan.policy.policy)
        layers.set_title(
            f"policy for {budget_text(plan.policy.memory_budget)}"
            + ("" if plan.policy.fits else " (nothing fits: the closest)")
        )
    else:
        figure, memory = plt.subplots(figsize=(7, 4))
    memory.plot(ks, [r.peak_bytes / GIB for r in plan.rows], "o-", label="peak activations")
    memory.set_xlabel("k (layers offloaded)")
    memory.set_ylabel("GiB")
    overhead = memory.twinx()
    overhead.plot(ks, [100 * r.overhead for r in plan.rows], "s--", color="C1")
    overhead.set_ylabel("predicted overhead, %", color="C1")
    memory.set_title(f"{plan.device.name}, L = {plan.num_layers} (predicted)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return None


#: a colour per policy choice, in plots
POLICY_COLOURS = {KEEP: "C7", OFFLOAD: "C0", CHECKPOINT: "C1", CHECKPOINT_OFFLOAD: "C2"}


def draw_policy(axes: Any, policy: Sequence[str]) -> None:
    """One coloured cell per layer, a legend of the choices."""
    for index, choice in enumerate(policy):
        axes.barh(0, 1, left=index, color=POLICY_COLOURS[choice], edgecolor="white")
    for choice, colour in POLICY_COLOURS.items():
        axes.barh(0, 0, color=colour, label=choice)
    axes.set_yticks([])
    axes.set_xlim(0, len(policy))
    axes.set_xlabel("layer")
    axes.legend(ncol=4, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.6))


def modules_argument(items: Sequence[str]) -> dict[str, str] | list[str]:
    """``--modules a b`` (a list: offload those, keep the rest) or ``--modules a=keep``."""
    if not any("=" in item for item in items):
        return list(items)
    pairs = [item.split("=", 1) if "=" in item else [item, "offload"] for item in items]
    return {name: choice for name, choice in pairs}


def print_saved_by(profile: LayerProfile) -> None:
    """One layer's saved bytes by submodule and by kind of operation (MiB)."""
    for title, table in (("submodule", profile.saved_by_module), ("kind", profile.saved_by_kind)):
        cells = ", ".join(f"{name or '(layer)'} {n / 2**20:.0f}" for name, n in table.items())
        print(f"saved per {title} (MiB): {cells}")
    kept = profile.kept_by_reason.get(KEPT_BY_MODULES, 0)
    print(f"modules= keeps {kept / 2**20:.0f} MiB per layer on the device")


def check_shape_flags(cli: Parser, args: argparse.Namespace) -> None:
    """``--hidden``, ``--heads`` and ``--dtype`` shape the layer of ``--gpt`` (and
    ``--dtype`` that of ``--hf-config``); a preset has its own, so with one they are
    refused rather than ignored.  Fills in the defaults where they apply."""
    source = "--hf-config" if args.hf_config else f"--preset {args.preset or 'llama8b-layer'}"
    for flag, value, applies in (
        ("--hidden", args.hidden, args.gpt),
        ("--heads", args.heads, args.gpt),
        ("--dtype", args.dtype, args.gpt or args.hf_config),
    ):
        if value is not None and not applies:
            takes = "--gpt and --hf-config" if flag == "--dtype" else "--gpt"
            cli.error(
                f"{flag} {value}: shapes the layer of {takes} only; {source} has its own "
                f"(see its description), so {flag} would be ignored: leave it out, or pass "
                f"{takes.split(' and ')[0]}"
            )
    args.hidden, args.heads = args.hidden or 4096, args.heads or 32
    args.dtype = args.dtype or "bf16"


def check_pipeline(cli: Parser, args: argparse.Namespace, num_layers: int) -> int:
    """The pipeline's flags, checked and completed; returns the layers of one stage
    (the model's layers over the stages), or ``num_layers`` without a pipeline."""
    if not args.pipeline_stages:
        for flag, value in (
            ("--microbatches", args.microbatches),
            ("--schedule", args.schedule),
            ("--virtual-stages", args.virtual_stages),
        ):
            if value is not None:
                cli.error(f"{flag} {value}: plans a pipeline; pass --pipeline-stages P too")
        return num_layers
    if args.microbatches is None:
        cli.error("--pipeline-stages: expected --microbatches M (the micro-batches per step)")
    if args.per_module:
        cli.error("--per-module: plans one stack, not a pipeline's stages; leave it out")
    args.schedule = args.schedule or "1f1b"
    if args.virtual_stages is not None and args.schedule != "interleaved":
        cli.error(
            f"--virtual-stages {args.virtual_stages}: sets the stages per rank of --schedule "
            f"interleaved, not of {args.schedule} (zbv has 2 per rank)"
        )
    per_rank = {"interleaved": args.virtual_stages or 2, "zbv": 2}.get(args.schedule, 1)
    args.virtual_stages = per_rank
    error = shape_error(
        num_layers, args.pipeline_stages, per_rank, args.schedule, args.microbatches
    )
    if error:
        cli.error(error)
    stages = args.pipeline_stages * per_rank
    return num_layers // stages


def plan_stages(
    args: argparse.Namespace,
    spec: LayerSpec,
    profile: LayerProfile,
    device: DeviceProfile,
    layers: int,
) -> PipelinePlan:
    """Every stage's plan (``--pipeline-stages``), printed; ``layers``: one stage's."""
    accumulate_s = layers * gradient_accumulation_s(spec.module(), device)
    stages = plan_pipeline(
        LayerCosts.of(profile, device),
        layers * args.pipeline_stages * args.virtual_stages,
        device.d2h,
        device.h2d,
        ranks=args.pipeline_stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        memory_budget=args.memory_budget,
        overhead_budget=args.overhead,
        accumulate_s=accumulate_s,
    )
    print_stages(stages)
    return stages


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


def stages_json(plan: PipelinePlan) -> dict[str, object]:
    """The JSON's ``"pipeline_schedule"`` and ``"stages"``."""
    return {
        "pipeline_schedule": {
            "schedule": plan.schedule,
            "pipeline_stages": plan.ranks,
            "microbatches": plan.microbatches,
            "stages_per_rank": plan.virtual_stages,
            "layers_per_stage": plan.layers_per_stage,
            "memory_budget_per_stage": plan.memory_budget,
        },
        "stages": [stage.to_json() for stage in plan.stages],
    }


def main(argv: Sequence[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    check_shape_flags(cli, args)
    if args.gpt and args.hidden % args.heads:
        cli.error(f"--hidden {args.hidden}: expected a multiple of --heads {args.heads}")
    try:
        device = with_flops(get_profile(args.device), args.flops)
    except (ValueError, TypeError, OSError) as error:
        cli.error(f"--device {args.device}: {error}")
    try:
        spec = layer_spec(args)
    except (ValueError, OSError) as error:
        cli.error(str(error))
    num_layers = args.layers or spec.num_layers or GPT_LAYERS
    if num_layers > MAX_LAYERS:
        cli.error(
            f"--hf-config {args.hf_config}: the model has {num_layers} layers, and a plan takes "
            f"at most {MAX_LAYERS}; pass --layers 2..{MAX_LAYERS}"
        )
    if args.memory_budget is not None and num_layers > MAX_SEARCH_LAYERS:
        cli.error(
            f"--memory-budget {args.memory_budget / GIB:g}: the policy search takes at most "
            f"{MAX_SEARCH_LAYERS} layers, not {num_layers} (its family of policies grows as "
            f"L^3); pass --layers 2..{MAX_SEARCH_LAYERS}, or leave out --memory-budget"
        )
    if args.memory_budget is not None and num_layers > 64:
        print(f"searching policies of {num_layers} layers: a minute or more ...", flush=True)
    if args.per_module and (args.memory_budget is None or args.modules):
        cli.error(
            "--per-module: chooses modules= with the policy for a memory budget; pass "
            "--memory-budget GiB and leave out --modules"
        )
    modules = modules_argument(args.modules) if args.modules else None
    node = Node(args.ranks_per_node, args.host_memory)
    budget = args.memory_budget  # bytes
    num_layers = check_pipeline(cli, args, num_layers)
    per_module = None
    if args.per_module and budget is not None:
        measure = dict(kwargs=spec.kwargs, min_offload_numel=args.min_offload_numel)
        measure |= dict(attention=args.attention, description=spec.description)
        search = ModuleSearch(spec.make_layer, spec.inputs, num_layers, device, **measure)
        per_module = search.choose(budget)
        print(per_module.summary())
    try:
        profile = (
            per_module.profile
            if per_module and per_module.profile
            else measure_layer(
                spec.make_layer,
                spec.inputs,
                kwargs=spec.kwargs,
                min_offload_numel=args.min_offload_numel,
                attention=args.attention,
                description=spec.description,
                modules=modules,
            )
        )
    except ValueError as error:
        if modules is None:
            raise
        cli.error(f"--modules: {error}")
    if modules is not None:
        print_saved_by(profile)
    stage_budget = None if args.pipeline_stages else budget  # a pipeline's: per stage
    plan = plan_offload(
        profile,
        num_layers,
        device,
        overhead_budget=args.overhead,
        memory_budget=stage_budget,
        host_cap=node.cap_per_rank,
    )
    print_plan(plan, spec.description, node)
    stages = plan_stages(args, spec, profile, device, num_layers) if args.pipeline_stages else None
    if args.json:
        with open(args.json, "w") as file:
            document = to_json(plan, spec.description, node)
            if stages is not None:
                document |= stages_json(stages)
            if per_module is not None:
                document["per_module"] = per_module.to_json()
            json.dump(document, file, indent=2)
    if args.plot:
        why = write_plot(plan, args.plot)
        print(f"plot: {why}" if why else f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
