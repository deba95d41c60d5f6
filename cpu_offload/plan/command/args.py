"""The command's flags: the parser, the layer they name, and their checks (a flag that
would be ignored, or a shape the planner cannot take, is an error that says how to fix
it)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ...cli import (
    Parser,
    at_least,
    fraction,
    int_in,
    memory_amount,
    output_file,
    plot_file,
    positive_float,
)
from ...device.profiles import PROFILES, DeviceProfile, get_profile, with_flops
from ...hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL
from ...models import DTYPES
from ..census import ATTENTIONS
from ..layers import LayerSpec, gpt_layer, hf_layer, preset_layer
from ..node import host_memory_argument
from ..pipeline.orders import SCHEDULES, shape_error
from ..planner import MAX_LAYERS, graph_error
from ..policy_search import MAX_SEARCH_LAYERS

__all__ = [
    "GPT_LAYERS",
    "PLAN_PRESETS",
    "check_cuda_graph",
    "check_pipeline",
    "add_budget_flags",
    "add_layer_flags",
    "add_pipeline_flags",
    "check_shape_flags",
    "layer_spec",
    "modules_argument",
    "parse",
    "parser",
]

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
    add_layer_flags(parser)
    add_budget_flags(parser)
    add_pipeline_flags(parser)
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="plan a training step captured in one CUDA graph and replayed "
        "(offload_layers(..., cuda_graph=True)): no host issue time in the step, its "
        "peak and pinned buffers held for the graph's life (default: off, an eager step)",
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


def add_layer_flags(parser: Parser) -> None:
    """The flags that shape the layer and the device it is planned on."""
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


def add_budget_flags(parser: Parser) -> None:
    """The flags of the budgets: overhead, memory, host memory, the modules kept."""
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


def add_pipeline_flags(parser: Parser) -> None:
    """The flags of ``--pipeline-stages`` (docs/pipeline.md)."""
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


def layer_spec(args: argparse.Namespace) -> LayerSpec:
    """The layer to measure (its ``num_layers``: the model's, where known)."""
    dtype = DTYPES[args.dtype]
    if args.hf_config:
        return hf_layer(args.hf_config, args.seq or 4096, args.batch or 1, dtype, args.attention)
    if args.gpt:
        seq, batch = args.seq or 2048, args.batch or 1
        return gpt_layer(seq, batch, args.hidden, args.heads, dtype, args.attention)
    return preset_layer(args.preset or "llama8b-layer", args.seq, args.batch)


def modules_argument(items: Sequence[str]) -> dict[str, str] | list[str]:
    """``--modules a b`` (a list: offload those, keep the rest) or ``--modules a=keep``."""
    if not any("=" in item for item in items):
        return list(items)
    pairs = [item.split("=", 1) if "=" in item else [item, "offload"] for item in items]
    return {name: choice for name, choice in pairs}


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


def check_cuda_graph(cli: Parser, args: argparse.Namespace, device: DeviceProfile) -> None:
    """``--cuda-graph`` plans one stack's step captured whole, on a CUDA device (NOTE
    [Planning a captured step] in planner.py)."""
    if not args.cuda_graph:
        return
    if args.pipeline_stages:
        cli.error(
            "--cuda-graph: plans one stack's step captured whole in one graph; a pipeline "
            "stage's step runs its schedule's actions from Python, micro-batch by "
            "micro-batch, and --pipeline-stages prices that eager order: leave out one of "
            "the two"
        )
    error = graph_error(device)
    if error:
        cli.error(f"--cuda-graph with --device {args.device}: {error}")


def parse(
    argv: Sequence[str] | None,
) -> tuple[Parser, argparse.Namespace, DeviceProfile, LayerSpec, int]:
    """The flags, parsed and checked: the parser (for the errors found later), the
    arguments, the device, the layer, and the layers to plan (one stage's, with
    ``--pipeline-stages``)."""
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
    num_layers = check_pipeline(cli, args, num_layers)
    check_cuda_graph(cli, args, device)
    return cli, args, device, spec, num_layers
