"""The benchmark's presets (model presets and how they run) and command-line flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from ..cli import Parser, at_least, device, int_list, memory_amount_list, output_file, plot_file
from ..device.profiles import PROFILES, get_profile
from ..hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL
from ..models import DTYPES
from ..models.presets import MODEL_PRESETS
from ..plan.pipeline import shape_error
from ..plan.planner import MAX_LAYERS

GIB = 2**30

__all__ = ["DTYPES", "MODES", "PRESETS", "BenchConfig", "modeling_line", "parse_args"]

#: the modes ``--modes`` accepts (``offload`` is one mode per k; ``offload:K`` one k)
MODES = ("none", "offload", "save_on_cpu", "checkpoint", "torchtune", "trl", "hf_offload")


#: how the benchmark runs each model preset (``presets.py``): the k to offload, the
#: warm-up and measured steps (the hooks preset runs its own modes, k = layers - 1, and
#: its steps are interleaved rounds)
_RUNS: dict[str, dict[str, object]] = {
    "tiny": dict(offload="1,2,3", warmup=1, steps=5),
    "llama8b-layer": dict(offload="1,2,3,4,5,6,7", warmup=3, steps=10),
    "hooks": dict(offload="", warmup=3, steps=30),
}
#: the presets ``--preset`` accepts: a model preset's shapes and its run
PRESETS: dict[str, dict[str, object]] = {
    name: {**shapes, **_RUNS[name]} for name, shapes in MODEL_PRESETS.items()
}


@dataclass
class BenchConfig:
    preset: str
    threads: int | None
    count: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int
    layers: int
    dtype: str
    offload: list[int]
    modes: list[str]
    warmup: int
    steps: int
    device: str | None
    min_offload_numel: int
    ceiling_mib: int
    json: str | None
    plot: str | None
    simulate: str | None = None
    trace: str | None = None
    memory_budget: list[float] | None = None
    pipeline_stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_simulate(parser, args)
    if args.count == "instructions" and args.preset != "hooks":
        parser.error(
            f"--count instructions: counts the hooks preset only, not --preset {args.preset}"
        )
    values = dict(PRESETS[args.preset])
    for key in (
        "hidden",
        "heads",
        "kv_heads",
        "ffn",
        "seq",
        "batch",
        "layers",
        "warmup",
        "steps",
        "dtype",
        "offload",
    ):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    _check_shapes(parser, args, values)
    offload = values.pop("offload")
    layers = int(str(values["layers"]))
    _check_pipeline(parser, args, layers)
    ks = _offloaded_ks(parser, args, offload, layers)
    modes = _modes(parser, args, ks, layers)
    return BenchConfig(
        preset=args.preset,
        threads=args.threads,
        count=args.count,
        offload=ks,
        modes=modes,
        device=args.device,
        min_offload_numel=args.min_offload_numel,
        ceiling_mib=args.ceiling_mib or 0,
        json=args.json,
        plot=args.plot,
        simulate=args.simulate,
        trace=args.trace,
        memory_budget=None if args.memory_budget is None else [b / GIB for b in args.memory_budget],
        pipeline_stages=args.pipeline_stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        **values,  # type: ignore[arg-type]
    )


def _parser() -> Parser:
    parser = Parser(
        prog="python -m cpu_offload.bench",
        description="Benchmark activation offload against the peers on a Llama-like stack.",
    )
    _add_model_flags(parser)
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="torch intra-op threads on a CPU (default 1: several threads on a shared "
        "machine oversubscribe it and step times swing tenfold)",
    )
    parser.add_argument(
        "--modes",
        default="none,offload,save_on_cpu,checkpoint,torchtune",
        help="comma-separated: none, offload (one mode per k), offload:K, save_on_cpu, "
        "checkpoint, torchtune, trl, hf_offload (--simulate: without offload, the peers side "
        "by side with ours at each peer's memory) (default %(default)s)",
    )
    parser.add_argument(
        "--device",
        type=device,
        default=None,
        help="cpu, cuda, npu, xpu (default: the best available)",
    )
    parser.add_argument(
        "--min-offload-numel",
        type=at_least(0),
        default=DEFAULT_MIN_OFFLOAD_NUMEL,
        help="smaller saved tensors stay on the device (default %(default)s)",
    )
    parser.add_argument(
        "--ceiling-mib",
        type=at_least(1),
        default=None,
        help="size of the raw copy that measures the link (default: 1024 on "
        "an accelerator, 64 on the CPU)",
    )
    parser.add_argument(
        "--count",
        choices=["time", "instructions"],
        default="time",
        help="--preset hooks: wall time of interleaved steps, or instructions counted by "
        "valgrind's callgrind (repeatable on a loaded machine; CPU thread time without "
        "valgrind) (default %(default)s)",
    )
    parser.add_argument(
        "--json",
        type=output_file,
        default=None,
        help="write all figures to this file (default: none written)",
    )
    parser.add_argument(
        "--plot",
        type=plot_file,
        default=None,
        help="write the plots to this file (.png, .pdf, ...; default: none drawn)",
    )
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        default=None,
        help=f"run the offload code on a modeled accelerator instead ({', '.join(PROFILES)}, "
        "or a JSON file of `python -m cpu_offload.check`): every k, shapes only, beside "
        "the planner's prediction (default: run on the device)",
    )
    parser.add_argument(
        "--memory-budget",
        metavar="GIB",
        type=memory_amount_list("--memory-budget"),
        default=None,
        help="--simulate: also the policies the planner chooses for these budgets of "
        "activation memory (comma-separated: GiB, or sizes with their unit: 10,512MiB)",
    )
    parser.add_argument(
        "--trace",
        metavar="PATH",
        type=output_file,
        default=None,
        help="--simulate: write the modeled timelines as Chrome-trace JSON (Perfetto)",
    )
    _add_pipeline_flags(parser)
    return parser


def _check_pipeline(parser: Parser, args: argparse.Namespace, layers: int) -> None:
    """The pipeline's flags: with --simulate, --microbatches and whole stages."""
    given = [
        (flag, value)
        for flag, value in (
            ("--pipeline-stages", args.pipeline_stages),
            ("--microbatches", args.microbatches),
            ("--schedule", args.schedule),
            ("--virtual-stages", args.virtual_stages),
        )
        if value is not None
    ]
    if not given:
        return
    if args.simulate is None or args.pipeline_stages is None or args.microbatches is None:
        flag, value = given[0]
        parser.error(
            f"{flag} {value}: models a pipeline's stages; pass --simulate PROFILE "
            "--pipeline-stages P --microbatches M"
        )
    for flag, value in (("--plot", args.plot), ("--offload", args.offload)):
        if value is not None:
            parser.error(
                f"{flag}: not taken with --pipeline-stages (each stage runs the policy the "
                "planner chose for it; --json and --trace hold its figures); leave it out"
            )
    args.schedule = args.schedule or "1f1b"
    if args.virtual_stages is not None and args.schedule != "interleaved":
        parser.error(
            f"--virtual-stages {args.virtual_stages}: sets the stages per rank of --schedule "
            f"interleaved, not of {args.schedule}"
        )
    per_rank = {"interleaved": args.virtual_stages or 2, "zbv": 2}.get(args.schedule, 1)
    error = shape_error(layers, args.pipeline_stages, per_rank, args.schedule, args.microbatches)
    if error:
        parser.error(error)


def _offloaded_ks(
    parser: Parser, args: argparse.Namespace, offload: object, layers: int
) -> list[int]:
    """The ``k`` values of the offload mode: ``--offload`` as given, else the preset's."""
    if isinstance(offload, list):  # --offload, as given
        ks = offload
        if any(not 0 < k < layers for k in ks):
            parser.error(
                f"--offload {','.join(map(str, ks))}: expected values in 1..{layers - 1} "
                f"(--layers {layers}; the last layer is never offloaded)"
            )
    else:  # the preset's, those the layers allow
        ks = [int(k) for k in str(offload).split(",") if k and int(k) < layers]
    if args.simulate is not None:  # every k by default; k = 0, the reference, always
        ks = sorted({0, *ks}) if isinstance(offload, list) else list(range(layers))
    return ks


def _modes(parser: Parser, args: argparse.Namespace, ks: list[int], layers: int) -> list[str]:
    """``--modes``, checked, with ``offload`` one mode per ``k``."""
    modes: list[str] = []
    for mode in args.modes.split(","):
        known = mode in MODES or (mode.startswith("offload:") and mode[8:].isdigit())
        if not known:
            parser.error(
                f"--modes {args.modes}: unknown mode {mode!r}; expected a comma-separated "
                f"list of {', '.join(MODES)} or offload:K"
            )
        if mode == "offload" and not ks and args.preset != "hooks":
            parser.error(
                f"--layers {layers}: the offload mode needs at least 2 layers (the last layer "
                "is never offloaded); pass --layers 2 or more, or --modes without offload"
            )
        modes.extend(f"offload:{k}" for k in ks) if mode == "offload" else modes.append(mode)
    return modes


def _check_simulate(parser: Parser, args: argparse.Namespace) -> None:
    """``--simulate`` names a profile; ``--trace`` and ``--memory-budget`` need it."""
    for flag, given in (("--trace", args.trace), ("--memory-budget", args.memory_budget)):
        if given is not None and args.simulate is None:
            parser.error(f"{flag}: needs --simulate PROFILE (it belongs to the modeled run)")
    if args.simulate is None:
        return
    if args.preset == "hooks":
        parser.error("--simulate: models a Llama preset (tiny, llama8b-layer), not --preset hooks")
    if args.layers is not None and args.layers > MAX_LAYERS:
        parser.error(
            f"--layers {args.layers}: a modeled run takes at most {MAX_LAYERS} layers, as the "
            f"planner does; pass --layers 2..{MAX_LAYERS}"
        )
    if args.device is not None:
        parser.error(
            f"--device {args.device}: --simulate runs on a modeled device, not on this "
            "machine's; drop --device"
        )
    try:
        get_profile(args.simulate)
    except (ValueError, TypeError, OSError) as error:
        parser.error(f"--simulate {args.simulate}: {error}")


def _check_shapes(parser: Parser, args: argparse.Namespace, values: dict[str, object]) -> None:
    """Heads that divide the width, key-value heads that divide the heads, and heads of an
    even width (rotary embeddings rotate pairs); the message names the flags given and
    the preset's values that were not."""

    def flag(name: str) -> str:
        given = getattr(args, name.replace("-", "_")) is not None
        value = values[name.replace("-", "_")]
        return f"--{name} {value}" + ("" if given else f" (the {args.preset} preset's)")

    def divides(part: str, whole: str) -> None:
        if int(str(values[whole.replace("-", "_")])) % int(str(values[part.replace("-", "_")])):
            if getattr(args, whole.replace("-", "_")) is None:  # only the part was given
                parser.error(f"{flag(part)}: expected a divisor of {flag(whole)}")
            parser.error(f"{flag(whole)}: expected a multiple of {flag(part)}")

    divides("heads", "hidden")
    divides("kv-heads", "heads")
    hidden, heads = int(str(values["hidden"])), int(str(values["heads"]))
    if (hidden // heads) % 2:
        parser.error(
            f"{flag('hidden')} over {flag('heads')}: heads of {hidden // heads} features; "
            "expected an even number (rotary embeddings rotate pairs of features)"
        )


def modeling_line(profile_name: str, runtime: str, config: BenchConfig, what: str) -> str:
    """The first line a modeled run prints: the profile, the preset's sizes and ``what``."""
    return (
        f"modeling {profile_name} ({runtime}), preset {config.preset}: {config.layers} "
        f"layers, hidden {config.hidden}, seq {config.seq}, batch {config.batch}, "
        f"{config.dtype}; {what}"
    )


def _add_model_flags(parser: Parser) -> None:
    """The preset and the flags that override its shapes and its run."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="the model and run (default tiny: {layers} Llama layers of hidden {hidden} at "
        "seq {seq}, {dtype}, seconds on a CPU; llama8b-layer: Llama-3-8B's layer shapes, for "
        "--simulate or a GPU; hooks: the host cost per tensor). The flags below override "
        "its values".format(**PRESETS["tiny"]),
    )
    said = {
        "hidden": "hidden size",
        "heads": "attention heads",
        "kv-heads": "key/value heads",
        "ffn": "MLP intermediate size",
        "seq": "tokens per sample",
        "batch": "samples per step",
        "layers": "decoder layers",
        "steps": "measured steps",
    }
    for name, what in said.items():
        parser.add_argument(
            f"--{name}", type=at_least(1), default=None, help=f"{what} (default: the preset's)"
        )
    parser.add_argument(
        "--warmup", type=at_least(0), default=None, help="unmeasured steps (default: the preset's)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="activations' dtype (default: the preset's)",
    )
    parser.add_argument(
        "--offload",
        type=int_list(1),
        default=None,
        help="comma-separated k values for ours (default: the preset's; with --simulate every k)",
    )


def _add_pipeline_flags(parser: Parser) -> None:
    """The pipeline's flags (--simulate)."""
    pipeline = parser.add_argument_group(
        "pipeline parallelism (--simulate)",
        "model each stage's order of forwards and backwards (docs/pipeline.md)",
    )
    pipeline.add_argument(
        "--pipeline-stages",
        type=at_least(2),
        default=None,
        metavar="P",
        help="stages that --layers are split into, whole layers each (with --microbatches; "
        "default: no pipeline)",
    )
    pipeline.add_argument(
        "--microbatches", type=at_least(1), default=None, metavar="M", help="per step"
    )
    pipeline.add_argument(
        "--schedule",
        choices=["1f1b", "interleaved", "gpipe", "zbv"],
        default=None,
        help="the order of each stage's passes (default 1f1b)",
    )
    pipeline.add_argument(
        "--virtual-stages",
        type=at_least(2),
        default=None,
        metavar="V",
        help="--schedule interleaved: stages per rank (2)",
    )
