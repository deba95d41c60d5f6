"""``python -m cpu_offload.check --full``: every check still owed to a GPU, in one command.

NOTE [The first hour on a GPU]
    The CPU proves ordering and parity; figures need a device.  ``--full`` runs, most
    valuable first, what only a device can settle: the device checks, ``pytest -m gpu``,
    the llama8b-layer benchmark, the peers' rows on the device, reloads in slices, on
    demand and tensor by tensor against the plain policy (NOTE [Reloads against the
    plain policy] in check_rows.py), the 2-rank pipeline with ``keep_passes`` and ZB-V,
    32 x 8k at k = 24, the pinned allocator's rounding and the host pool against
    ``host_memory_stats()``, layers compiled with ``fullgraph=True``, and a step
    captured with ``cuda_graph=True`` and replayed.  Each row reads PASS, FAIL
    or NOT RUN, with its figure and what it needs; the JSON holds them, and the rows
    print as a table for docs/benchmarks.md.  With ``--simulate PROFILE`` it runs every
    row it can on the modeled accelerator on the CPU (the benchmarks' ``--simulate``),
    so that the command itself is tested in CI before it meets a GPU; a row the model
    cannot settle says NOT RUN and what it needs.  Rows that run the offloader in this
    process are in check_rows.py; benchmarks run as processes of their own (the package
    never imports the benchmark).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from . import check_rows

__all__ = ["FullRow", "run_full"]

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
MIB = 2**20


@dataclass
class FullRow:
    """One check of ``--full``.

    Attributes:
        name: what is checked.
        status: PASS, FAIL or NOT RUN.
        figure: what it measured (or why it did not run).
        needs: what it needs to run on the device.
        seconds: how long it took.
    """

    name: str
    status: str
    figure: str
    needs: str
    seconds: float = 0.0


Runner = Callable[[str, "str | None"], tuple[str, str]]


def _bench(argv: list[str]) -> tuple[str, str]:
    """``python -m cpu_offload.bench`` (a process of its own: the package never imports the
    benchmark): PASS with its summary (the model's agreement with the planner, or ours
    beside each peer)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.json")
        command = [sys.executable, "-m", "cpu_offload.bench", *argv, "--json", path]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        figures = {}
        if os.path.exists(path):
            with open(path) as file:
                figures = json.load(file)
    code = done.returncode
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    figure = next((line for line in reversed(lines) if "agreement" in line), "")
    if "peers" in figures:
        figure = "; ".join(
            f"{row['mode']}: peer/ours {row['ours_speedup']:.2f}"
            f"{'' if row['ours_fits'] else ' (ours over its peak)'}"
            for row in figures["peers"]
            if "ours_speedup" in row
        )
    if "modes" in figures:  # measured on the device: each mode's step and peak
        figure = "; ".join(_measured_mode(row) for row in figures["modes"])
    return (PASS if code == 0 else FAIL), figure or (lines[-1] if lines else "")


def _measured_mode(row: dict) -> str:
    if row.get("skipped"):
        return f"{row['mode']}: skipped ({row['skipped']})"
    peak = row.get("peak_bytes")
    shown = f"{row['mode']}: {row['median_step_ms']:.1f} ms"
    return shown + ("" if peak is None else f", peak {peak / 2**30:.2f} GiB")


def _on(device: str, simulate: str | None) -> list[str]:
    return ["--simulate", simulate] if simulate else ["--device", device]


def gpu_tests(device: str, simulate: str | None) -> tuple[str, str]:
    if simulate or device == "cpu":
        return NOT_RUN, "pytest -m gpu runs on a GPU only"
    if not os.path.isdir("tests"):
        return NOT_RUN, "run from the repository's root (tests/ is not here)"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return (PASS if done.returncode == 0 else FAIL), last


def llama_layer(device: str, simulate: str | None) -> tuple[str, str]:
    return _bench(["--preset", "llama8b-layer", *_on(device, simulate)])


def peers(device: str, simulate: str | None) -> tuple[str, str]:
    modes = "checkpoint,save_on_cpu,torchtune,trl"
    size = ["tiny", "--layers", "3", "--seq", "128"] if simulate else ["llama8b-layer"]
    return _bench(["--preset", *size, *_on(device, simulate), "--modes", modes])


def pipeline(device: str, simulate: str | None) -> tuple[str, str]:
    if simulate:
        argv = ["--preset", "tiny", "--pipeline-stages", "2", "--microbatches", "4"]
        return _bench([*argv, "--schedule", "zbv", "--simulate", simulate])
    count = getattr(torch, device, None)
    if count is None or count.device_count() < 2:
        return NOT_RUN, "needs 2 GPUs (nccl)"
    command = ["torchrun", "--standalone", "--nproc-per-node", "2"]
    command += ["examples/pipeline_parallel.py", "--memory-budget", "4.5MiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return (PASS if done.returncode == 0 else FAIL), last


def long_sequences(device: str, simulate: str | None) -> tuple[str, str]:
    argv = ["--preset", "llama8b-layer", "--layers", "32", "--seq", "8192", "--offload", "24"]
    if not simulate:  # offload:24 only: without offload the stack does not fit in 80 GB
        argv += ["--steps", "2", "--warmup", "1", "--modes", "offload"]
    return _bench([*argv, *_on(device, simulate)])


def pinned_rounding(device: str, simulate: str | None) -> tuple[str, str]:
    from .device.runtime import pinned_memory_stats
    from .testing.pinned_memory import held_bytes, round_threshold

    modeled = held_bytes(600 * MIB, round_threshold())
    stats = None if simulate or device == "cpu" else pinned_memory_stats(device)
    if stats is None:
        return NOT_RUN, f"modeled: 600 MiB pinned holds {modeled // MIB} MiB"
    key = "allocated_bytes.current"
    tensor = torch.empty(600 * MIB, dtype=torch.uint8, pin_memory=True)
    held = (pinned_memory_stats(device) or {}).get(key, 0) - stats.get(key, 0)
    del tensor
    figure = f"600 MiB pinned: torch holds {held // MIB} MiB, the model {modeled // MIB} MiB"
    return (PASS if held == modeled else FAIL), figure


#: (name, needs, runner), most valuable after the device checks (check.py's, first)
CHECKS: list[tuple[str, str, Runner]] = [
    ("pytest -m gpu", "a GPU, the repository's tests/", gpu_tests),
    ("llama8b-layer benchmark", "a GPU (else --simulate)", llama_layer),
    ("peers' rows", "a GPU, torchtune and trl (else --simulate)", peers),
    (
        "sliced reloads, on-demand layers and per-tensor release (peak and step)",
        "a GPU with 24 GB (else --simulate)",
        check_rows.reloads,
    ),
    ("keep_passes and ZB-V, 2-rank pipeline", "2 GPUs and nccl (else --simulate)", pipeline),
    ("32 x 8k at k = 24", "a GPU with 80 GB (else --simulate)", long_sequences),
    ("pinned rounding vs host_memory_stats()", "a CUDA GPU", pinned_rounding),
    ("host pool vs host_memory_stats()", "a CUDA GPU (else --simulate)", check_rows.host_pool),
    ("compile: fullgraph blocks", "torch.compile (a GPU: inductor)", check_rows.compiled_blocks),
    ("cuda_graph: a captured step", "a CUDA GPU (else --simulate)", check_rows.cuda_graph),
]


def run_full(device: str | None, simulate: str | None, device_checks: Runner) -> list[FullRow]:
    """Every row of ``--full`` (NOTE [The first hour on a GPU]), ``device_checks`` first."""
    from .device.runtime import available_device_type

    where = device or available_device_type()
    rows = []
    for name, needs, runner in [("device checks", "a GPU or NPU", device_checks), *CHECKS]:
        start = time.perf_counter()
        try:
            status, figure = runner(where, simulate)
        except Exception as error:  # noqa: BLE001 - a row that raises is a FAIL row
            status, figure = FAIL, f"{type(error).__name__}: {error}"
        rows.append(FullRow(name, status, figure, needs, time.perf_counter() - start))
        print(f"{status:8} {name}: {figure}", flush=True)
    return rows


def report_full(rows: Sequence[FullRow], simulate: str | None, path: str | None) -> int:
    """Print the rows for docs/benchmarks.md, write the JSON; 1 when a row FAILs."""
    where = f"modeled {simulate}" if simulate else "this device"
    print(f"\n| check ({where}) | status | figure | needs |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row.name} | {row.status} | {row.figure} | {row.needs} |")
    if path:
        environment = {"torch": torch.__version__, "simulate": simulate}
        with open(path, "w") as file:
            document = {"environment": environment, "checks": [asdict(r) for r in rows]}
            json.dump(document, file, indent=2)
    return 1 if any(row.status == FAIL for row in rows) else 0
