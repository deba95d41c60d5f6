"""Runs every mode on one model and one set of inputs, then reports."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..device.link import measure_ceiling
from ..device.runtime import available_device_type, device_name, get_backend
from ..models.llama import LlamaConfig, LlamaLayer
from .config import DTYPES, BenchConfig, modeling_line, parse_args
from .counting import (
    ENV_OUT,
    Collector,
    callgrind_available,
    count_under_callgrind,
    load_modes,
    write_modes,
)
from .hooks import count_hook_costs, measure_hook_costs, print_counts, print_hook_costs
from .measure import ModeResult, measure_modes
from .modes import make_mode
from .report import print_table, write_json, write_plot

__all__ = ["main", "run_benchmark"]


def run_benchmark(config: BenchConfig) -> tuple[list[ModeResult], dict[str, float], dict]:
    backend = get_backend(config.device)
    dtype = DTYPES[config.dtype]
    torch.manual_seed(0)
    layer_config = LlamaConfig(
        config.hidden, config.heads, config.kv_heads, config.ffn, config.layers
    )
    layers = torch.nn.ModuleList(LlamaLayer(layer_config) for _ in range(config.layers)).to(
        backend.device, dtype
    )
    generator = torch.Generator().manual_seed(1)
    inputs = [
        torch.randn(config.batch, config.seq, config.hidden, generator=generator)
        .to(backend.device, dtype)
        .requires_grad_()
        for _ in range(config.steps)
    ]
    environment = {
        "device": str(backend.device),
        "device_name": device_name(backend.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "command": "python -m cpu_offload.bench " + " ".join(sys.argv[1:]),
    }
    modes = [
        make_mode(name, config.layers, backend, config.min_offload_numel) for name in config.modes
    ]
    for mode in modes:
        if mode.skip_reason:
            print(f"{mode.name}: skipped, {mode.skip_reason}", flush=True)
    began = time.perf_counter()

    def progress(name: str) -> None:
        print(f"warmed up {name} ({time.perf_counter() - began:.1f} s)", flush=True)

    print(f"measuring {len(inputs)} interleaved steps per mode ...", flush=True)
    results = measure_modes(modes, layers, inputs, backend, config.warmup, progress=progress)
    del modes
    ceiling_mib = config.ceiling_mib or (64 if backend.device.type == "cpu" else 1024)
    ceiling = measure_ceiling(backend, ceiling_mib * 2**20)
    _derive(results, config.layers)
    return results, ceiling, environment


def _derive(results: list[ModeResult], layers: int) -> None:
    """Overhead and memory figures against the ``none`` mode."""
    base = next((r for r in results if r.mode == "none" and not r.skipped), None)
    if base is None:
        return
    per_layer = None
    if base.end_of_forward_bytes is not None and base.baseline_bytes is not None:
        per_layer = (base.end_of_forward_bytes - base.baseline_bytes) / layers
    for r in results:
        if r.skipped:
            continue
        if r.median_step_ms is not None and base.median_step_ms is not None:
            r.overhead_pct = 100 * (r.median_step_ms / base.median_step_ms - 1)
        if r.end_of_forward_bytes is not None and base.end_of_forward_bytes is not None:
            r.memory_saved_bytes = base.end_of_forward_bytes - r.end_of_forward_bytes
        if r.mode.startswith("offload:") and per_layer is not None and r.baseline_bytes is not None:
            k = int(r.mode.split(":")[1])
            r.analytic_end_of_forward_bytes = int(r.baseline_bytes + (layers - k) * per_layer)


def _set_threads(config: BenchConfig) -> int:
    """One intra-op thread on a CPU unless ``--threads`` says otherwise (see its help)."""
    on_cpu = (torch.device(config.device).type if config.device else available_device_type()) == (
        "cpu"
    )
    if config.threads is not None or on_cpu:
        torch.set_num_threads(config.threads or 1)
    return torch.get_num_threads()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse_args(argv)
    threads = _set_threads(config)
    if config.count == "instructions":
        return _count_hooks(config, argv)
    print(f"torch intra-op threads: {threads} (--threads)", flush=True)
    if config.preset == "hooks":
        return _main_hooks(config)
    if config.simulate is not None:
        return _main_simulate(config)
    too_large = _too_large(config)
    if too_large:
        return _usage_error(too_large)
    try:
        results, ceiling, environment = run_benchmark(config)
    except RuntimeError as error:  # torch.OutOfMemoryError, or the CPU allocator's
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, torch.OutOfMemoryError) and not any(
            words in first_line.lower() for words in OUT_OF_MEMORY
        ):
            raise
        return _usage_error(
            f"{_sizes(config)}: out of memory ({first_line}); use a smaller --seq, --batch, "
            "--steps or --layers"
        )
    print(
        f"\n{environment['device']} ({environment['device_name']}), torch "
        f"{environment['torch']}, preset {config.preset}: {config.layers} layers, hidden "
        f"{config.hidden}, seq {config.seq}, batch {config.batch}, {config.dtype}"
    )
    print_table(results, ceiling)
    if config.json:
        write_json(config.json, environment, config, results, ceiling)
        print(f"figures written to {config.json}")
    if config.plot:
        title = (
            f"{environment['device_name']}, torch {environment['torch']}: {environment['command']}"
        )
        reason = write_plot(config.plot, results, title)
        print(f"plot not written: {reason}" if reason else f"plot written to {config.plot}")
    return 0


#: how the CPU allocator and the accelerators' runtimes say they ran out of memory
OUT_OF_MEMORY = ("out of memory", "not enough memory", "can't allocate memory")


def _sizes(config: BenchConfig) -> str:
    return (
        f"--seq {config.seq} --batch {config.batch} --hidden {config.hidden} "
        f"--layers {config.layers} --steps {config.steps}"
    )


def _usage_error(message: str) -> int:
    """Bad sizes: one line, exit status 2, as the parser says a wrong flag."""
    print(f"python -m cpu_offload.bench: error: {message}", file=sys.stderr)
    return 2


def _too_large(config: BenchConfig) -> str | None:
    """Why the run cannot fit in the device's available memory, before anything is
    allocated: its inputs (all ``--steps`` of them are made first) and the saved
    activations of one step without offload (the ``none`` mode), measured by the
    planner's census on the meta device.  None when it may fit, or where the device does
    not say what it has."""
    from ..plan.census import measure_layer

    backend = get_backend(config.device)
    available = backend.memory_available()
    if available is None:
        return None
    dtype = DTYPES[config.dtype]
    layer_config = LlamaConfig(config.hidden, config.heads, config.kv_heads, config.ffn, 1)
    x = torch.empty(config.batch, config.seq, config.hidden, device="meta", dtype=dtype)
    cpu = backend.device.type == "cpu"
    layer = measure_layer(
        lambda: LlamaLayer(layer_config).to(dtype),
        x,
        min_offload_numel=0,
        attention="cpu" if cpu else "flash",
        fused_dropout=not cpu,
    )
    inputs = config.steps * x.numel() * x.element_size()
    needed = inputs + config.layers * layer.saved_bytes
    if needed <= available:
        return None
    gib = 2**30
    return (
        f"{_sizes(config)}: the run needs at least {needed / gib:.1f} GiB ({inputs / gib:.1f} "
        f"GiB of inputs, {layer.saved_bytes / gib:.1f} GiB of activations per layer), and "
        f"{backend.device} has {available / gib:.1f} GiB available; use a smaller --seq, "
        "--batch, --steps or --layers"
    )


def _count_hooks(config: BenchConfig, argv: list[str]) -> int:
    """``--preset hooks --count instructions``: see :mod:`cpu_offload.bench.counting`."""
    backend = get_backend(config.device)
    sizes = dict(layers=config.layers, width=config.hidden, batch=config.batch)
    inside = os.environ.get(ENV_OUT)
    if inside:  # the measuring process, under callgrind
        write_modes(inside, count_hook_costs(backend, Collector(True), **sizes))
        return 0
    print(
        f"{backend.device} ({device_name(backend.device)}), torch {torch.__version__}, "
        f"preset hooks: {config.layers} layers of Linear+GELU+LayerNorm, width "
        f"{config.hidden}, batch {config.batch}, torch threads {torch.get_num_threads()}"
    )
    if callgrind_available():
        modes, unit = count_under_callgrind(argv, load_modes), "instructions"
    else:
        print("valgrind not found: counting CPU time of this thread instead (ns)")
        modes, unit = count_hook_costs(backend, Collector(False), **sizes), "ns"
    print_counts(modes, unit)
    if config.json:
        with open(config.json, "w") as handle:
            json.dump({"unit": unit, "modes": [dataclasses.asdict(m) for m in modes]}, handle)
        print(f"figures written to {config.json}")
    return 0


def _main_hooks(config: BenchConfig) -> int:
    backend = get_backend(config.device)
    results = measure_hook_costs(
        backend, config.layers, config.hidden, config.batch, config.steps, config.warmup
    )
    print(
        f"\n{backend.device} ({device_name(backend.device)}), torch {torch.__version__}, "
        f"preset hooks: {config.layers} layers of Linear+GELU+LayerNorm, width "
        f"{config.hidden}, batch {config.batch}, {config.steps} interleaved rounds"
    )
    print_hook_costs(results)
    if config.json:
        environment = {"device": str(backend.device), "torch": torch.__version__}
        with open(config.json, "w") as handle:
            json.dump(
                {"environment": environment, "modes": [dataclasses.asdict(r) for r in results]},
                handle,
                indent=2,
            )
        print(f"figures written to {config.json}")
    return 0


def _main_simulate(config: BenchConfig) -> int:
    """``--simulate PROFILE``: see :mod:`cpu_offload.bench.simulate`."""
    from ..device.profiles import get_profile
    from ..testing.trace import write_trace
    from .simulate import SimulatedRow, run_simulation
    from .simulate_report import print_simulation, write_simulation_json, write_simulation_plot

    profile = get_profile(str(config.simulate))
    command = "python -m cpu_offload.bench " + " ".join(sys.argv[1:])
    if config.pipeline_stages is not None:
        return _main_pipeline(config, profile, command)
    if not any(mode.startswith("offload:") for mode in config.modes):
        from .peers_main import main_peers

        return main_peers(config, profile, command)
    print(modeling_line(profile.name, profile.runtime, config, "shapes only"), flush=True)
    began = time.perf_counter()

    def progress(row: SimulatedRow) -> None:
        print(f"modeled {row.label} ({time.perf_counter() - began:.1f} s)", flush=True)

    simulation = run_simulation(
        config, str(config.simulate), config.offload, config.memory_budget or (), progress
    )
    print()
    print_simulation(simulation, profile)
    environment = {
        "device": "modeled",
        "device_name": f"modeled {profile.name}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "command": command,
    }
    if config.json:
        write_simulation_json(config.json, simulation, profile, environment, config)
        print(f"figures written to {config.json}")
    if config.trace:
        write_trace(config.trace, [(row.label, row.modeled) for row in simulation.rows])
        print(f"trace written to {config.trace} (open it in https://ui.perfetto.dev)")
    if config.plot:
        reason = write_simulation_plot(
            config.plot, simulation, f"modeled {profile.name}: {command}"
        )
        print(f"plot not written: {reason}" if reason else f"plot written to {config.plot}")
    return 0


def _main_pipeline(config: BenchConfig, profile: Any, command: str) -> int:
    """``--simulate PROFILE --pipeline-stages P``: see :mod:`cpu_offload.bench.pipeline`."""
    from ..testing.trace import write_trace
    from .pipeline import ModeledStage, print_pipeline, run_pipeline

    print(modeling_line(profile.name, profile.runtime, config, "shapes only"), flush=True)
    began = time.perf_counter()

    def progress(stage: ModeledStage) -> None:
        print(f"modeled stage {stage.plan.stage} ({time.perf_counter() - began:.1f} s)")

    simulation = run_pipeline(config, str(config.simulate), progress)
    print()
    print_pipeline(simulation)
    if config.json:
        document = {
            "environment": {
                "device": "modeled",
                "device_name": f"modeled {profile.name}",
                "torch": torch.__version__,
                "command": command,
            },
            "config": dataclasses.asdict(config),
            "pipeline": [stage.as_json() for stage in simulation.stages],
            "agreement": simulation.worst(),
        }
        with open(config.json, "w") as file:
            json.dump(document, file, indent=2)
        print(f"figures written to {config.json}")
    if config.trace:
        write_trace(config.trace, [(f"stage {s.plan.stage}", s.modeled) for s in simulation.stages])
        print(f"trace written to {config.trace} (open it in https://ui.perfetto.dev)")
    return 0
