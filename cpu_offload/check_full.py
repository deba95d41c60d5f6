"""``python -m cpu_offload.check --full``: every check still owed to a GPU, in one command.

NOTE [The first hour on a GPU]
    The CPU proves ordering and parity; figures need a device.  ``--full`` runs, most
    valuable first, what only a device can settle: the device checks, ``pytest -m gpu``,
    the llama8b-layer benchmark, the peers' rows on the device, reloads in slices, on
    demand and tensor by tensor against the plain policy (NOTE [Reloads against the
    plain policy] in check_rows.py), the 2-rank pipeline with ``keep_passes`` and ZB-V,
    32 x 8k at k = 24, the pinned allocator's rounding and the host pool against
    ``host_memory_stats()``, layers compiled with ``fullgraph=True``, a step captured
    with ``cuda_graph=True`` and replayed, and the five graph checks of NOTE [The
    review's graph checks].  Each row reads PASS, FAIL or NOT RUN, with its figure and
    what it needs; the JSON holds them, and the rows print as a table for
    docs/benchmarks.md.  With ``--simulate PROFILE`` it runs every row it can on the
    modeled accelerator on the CPU (the benchmarks' ``--simulate``), so that the command
    itself is tested in CI before it meets a GPU; a row the model cannot settle says NOT
    RUN and what it needs.  Rows that run the offloader in this process are in
    check_rows.py (the review's graph checks are here, check_rows.py being full);
    benchmarks run as processes of their own (the package never imports the benchmark).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch import nn

from . import check_rows
from .context import get_cpu_offload_context
from .device.runtime import deterministic_algorithms, graph_runtime
from .report.copy_timer import CopyTimer

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


# NOTE [The review's graph checks]
#     Five checks the review of cuda_graph= owes a GPU (docs/cuda_graphs.md), each on
#     REVIEW_LAYERS MLP blocks, half offloaded, captured with cuda_graph=True: (a) an
#     eager forward, a replay, then its backward: its input gradient bit-identical to
#     eager without offload (a capture's host buffers are its own); (b) a copy timer: a
#     bandwidth from the eager step's copies only (a captured event has no elapsed time);
#     (c) no eager step before the capture (torch >= 2.11 pins memory in a capture) and
#     (d) each block's ops on a side stream joined to the capture (record_stream under
#     capture): 3 replays bit-identical to eager; (e) the context let go while its graph
#     lives, new pinned tensors of its buffers' sizes, a replay: their contents unchanged.
#     On a GPU: width 1024, 4096 rows, deterministic kernels.  Under --simulate: (a), (c)
#     in data mode (values; width 32, 8 rows: it computes on one stream), (b), (d) shapes
#     only (each replay copies what the others do; the model sees no block reuse inside a
#     capture), (e) NOT RUN.

REVIEW_LAYERS, REVIEW_REPLAYS, REVIEW_WIDTH, REVIEW_ROWS = 4, 3, 1024, 4096
NOT_MODELED = "the modeled pinned allocator does not model torch's reuse of a captured block"


class _SideStream(nn.Module):
    """A block whose ops run on a side stream joined to the caller's (check d)."""

    def __init__(self, inner: nn.Module, runtime: Any) -> None:
        super().__init__()
        self.inner, self.runtime, self.side = inner, runtime, runtime.Stream()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        current = self.runtime.current_stream()
        self.side.wait_stream(current)
        with self.runtime.stream(self.side):
            y = self.inner(x)
        current.wait_stream(self.side)
        return y


def _loss(layers: nn.ModuleList, x: torch.Tensor, ctx: Any = None, sync_fn: Any = None):
    for layer in layers:
        with contextlib.nullcontext() if ctx is None else ctx:
            x = layer(x)
        x = x if sync_fn is None else sync_fn(x)
    return x.square().sum()


class _Review:
    """Where the checks of NOTE [The review's graph checks] run: the graph runtime (the
    device's, or the modeled one in data mode), the tensors' device, width and rows."""

    def __init__(self, runtime: Any, device: str, width: int, rows: int) -> None:
        self.rt, self.device, self.width, self.rows = runtime, device, width, rows
        self.warm_on_side = device != "cpu"  # PyTorch's recipe; the data mode has one stream
        self.copied: dict[str, int] | None = None  # shapes only: the bytes copied so far

    def blocks(self, side: bool = False) -> nn.ModuleList:
        torch.manual_seed(0)  # the same weights each time
        width = self.width
        with torch.device(self.device):
            blocks = [
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(REVIEW_LAYERS)
            ]
        return nn.ModuleList(_SideStream(b, self.rt) if side else b for b in blocks)

    def inputs(self, count: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        shape = (self.rows, self.width)
        return [torch.randn(shape, generator=generator).to(self.device) for _ in range(count)]

    def context(self, timer: bool = False) -> tuple[Any, Any]:
        ctx, sync_fn = get_cpu_offload_context(
            True, REVIEW_LAYERS // 2, REVIEW_LAYERS, min_offload_numel=0, cuda_graph=True
        )
        if timer:
            synchronizer = cast(Any, ctx).offload_synchronizer
            synchronizer.copy_timer = CopyTimer(synchronizer.backend)
        return ctx, sync_fn

    def expected(self, x: torch.Tensor, side: bool = False) -> list[torch.Tensor]:
        """``x``'s and the weights' gradients of an eager step without offload."""
        layers, leaf = self.blocks(side), x.clone().requires_grad_()
        _loss(layers, leaf).backward()
        self.rt.synchronize()
        return [cast(torch.Tensor, t.grad) for t in [leaf, *layers.parameters()]]

    def capture(self, ctx: Any, sync_fn: Any, layers: nn.ModuleList, x: torch.Tensor, warm: bool):
        """A step captured (after an eager one on a side stream when ``warm``), the
        gradients preallocated, as a graph's outputs are."""
        for tensor in [x, *layers.parameters()]:
            tensor.grad = torch.zeros_like(tensor)
        if warm:
            side, current = self.rt.Stream(), self.rt.current_stream()
            side.wait_stream(current)
            with self.rt.stream(side if self.warm_on_side else current):
                _loss(layers, x, ctx, sync_fn).backward()
            current.wait_stream(side)
        graph = self.rt.CUDAGraph()
        with self.rt.graph(graph):
            _loss(layers, x, ctx, sync_fn).backward()
        return graph

    def replays(self, side: bool, warm: bool) -> tuple[bool, str]:
        """Captured once, replayed on :data:`REVIEW_REPLAYS` inputs, each replay's
        gradients against eager without offload (checks c and d)."""
        xs, layers = self.inputs(REVIEW_REPLAYS), self.blocks(side)
        static = torch.zeros_like(xs[0], requires_grad=True)
        graph = self.capture(*self.context(), layers, static, warm)
        tensors, same, moved = [static, *layers.parameters()], [], []
        for x in xs:
            static.detach().copy_(x)
            for tensor in tensors:
                cast(torch.Tensor, tensor.grad).zero_()
            before = dict(self.copied or {})
            graph.replay()
            self.rt.synchronize()
            if self.copied is not None:  # shapes only: what each replay copied
                moved.append(tuple(self.copied[k] - before.get(k, 0) for k in ("d2h", "h2d")))
            else:
                got = [cast(torch.Tensor, t.grad) for t in tensors]
                same.append(all(map(torch.equal, self.expected(x, side), got)))
        if self.copied is None:
            return all(same), f"gradients of {len(xs)} replays bit-identical to eager: {same}"
        out, back = (n / MIB for n in moved[0])
        figure = f"shapes only: each of {len(xs)} replays copied {out:.2f} MiB out, {back:.2f} back"
        return len(set(moved)) == 1 and min(moved[0]) > 0, f"{figure}: {set(moved) == {moved[0]}}"

    def eager_across_a_replay(self) -> tuple[bool, str]:
        xs, layers = self.inputs(3), self.blocks()
        want = self.expected(xs[1])[0]
        ctx, sync_fn = self.context()
        static = xs[0].clone().requires_grad_()
        graph = self.capture(ctx, sync_fn, layers, static, warm=True)
        leaf = xs[1].clone().requires_grad_()
        loss = _loss(layers, leaf, ctx, sync_fn)  # its offloaded layers wait on the host
        static.detach().copy_(xs[2])
        graph.replay()
        loss.backward()
        self.rt.synchronize()
        same = torch.equal(cast(torch.Tensor, leaf.grad), want)
        shown = "bit-identical to" if same else "DIFFERS from"
        return same, f"the eager pass's input gradient {shown} eager without offload"

    def copy_timer(self) -> tuple[bool, str]:
        layers, (ctx, sync_fn) = self.blocks(), self.context(timer=True)
        static = self.inputs(1)[0].requires_grad_()
        graph = self.capture(ctx, sync_fn, layers, static, warm=True)
        graph.replay()
        self.rt.synchronize()
        timer, eager = ctx.offload_synchronizer.copy_timer, 2 * (REVIEW_LAYERS // 2)
        bandwidth, spans = timer.bandwidth("d2h"), len(timer.spans)
        shown = "none" if bandwidth is None else f"{bandwidth / 1e9:.1f} GB/s"
        figure = f"d2h {shown} over {spans} copies timed (the eager step's: {eager})"
        return bandwidth is not None and spans == eager, figure

    def no_warm_up(self) -> tuple[bool, str]:
        return self.replays(side=False, warm=False)

    def side_stream(self) -> tuple[bool, str]:
        return self.replays(side=True, warm=True)

    def graph_outlives_its_context(self) -> tuple[bool, str]:
        layers, (ctx, sync_fn) = self.blocks(), self.context()
        static = self.inputs(1)[0].requires_grad_()
        graph = self.capture(ctx, sync_fn, layers, static, warm=True)
        pool = ctx.offload_synchronizer.host_buffers
        owned = [t for ts in pool._graphs_own.values() for t in ts if t is not None]
        addresses = {t.untyped_storage().data_ptr() for t in owned}
        sizes, alive = [t.untyped_storage().nbytes() for t in owned], weakref.ref(pool)
        del ctx, sync_fn, pool, owned
        gc.collect()
        fresh = [torch.full((n,), 7, dtype=torch.uint8, pin_memory=True) for n in sizes]
        reused = sum(t.data_ptr() in addresses for t in fresh)
        graph.replay()
        self.rt.synchronize()
        intact = all(bool((t == 7).all()) for t in fresh)
        freed, shown = alive() is None, "intact" if intact else "OVERWRITTEN by the replay"
        figure = f"{reused} of {len(fresh)} new pinned tensors at a graph's address, {shown}"
        return intact and freed and len(fresh) > 0, figure + ("" if freed else ", context alive")


#: NOTE [The review's graph checks]: (label, method, the model's mode, else why not)
REVIEW_CHECKS = [
    ("a", "eager_across_a_replay", "data"),
    ("b", "copy_timer", "shapes"),
    ("c", "no_warm_up", "data"),
    ("d", "side_stream", "shapes"),
    ("e", "graph_outlives_its_context", NOT_MODELED),
]


@contextlib.contextmanager
def _modeled_review(profile: str, mode: str) -> Iterator[_Review]:
    """The modeled graphs in data mode (the CPU's values), or shapes only under
    ``modeled_cuda``."""
    from .testing import timed_runtime
    from .testing.modeled_cuda import modeled_cuda

    data = mode == "data"
    with timed_runtime(profile, flavour="cuda", data=data, record=False) as run:
        live: Any = run.live
        with contextlib.nullcontext() if data else modeled_cuda(live):
            review = _Review(live, "cpu", 32, 8) if data else _Review(live, "cuda", 1024, 4096)
            review.copied = None if data else live.timeline.copied
            yield review


def _review_check(device: str, simulate: str | None, label: str, method: str, model: str):
    """One check of NOTE [The review's graph checks]: (status, figure)."""
    if simulate and model not in ("data", "shapes"):
        return NOT_RUN, model
    device_review = _Review(graph_runtime(device), device, REVIEW_WIDTH, REVIEW_ROWS)
    around = _modeled_review(simulate, model) if simulate else contextlib.nullcontext(device_review)
    try:
        with around as review, deterministic_algorithms():
            holds, figure = getattr(review, method)()
        return (PASS if holds else FAIL), figure
    except Exception as error:  # noqa: BLE001 - a check that raises is a FAIL
        return FAIL, f"{type(error).__name__}: {error}"


def graph_review(device: str, simulate: str | None) -> tuple[str, str]:
    """NOTE [The review's graph checks]: FAIL when one fails, PASS when one passes."""
    if not simulate and (device == "cpu" or graph_runtime(device) is None):
        return NOT_RUN, f"{device} captures no graphs (else --simulate)"
    results = [
        (label, *_review_check(device, simulate, label, method, model))
        for label, method, model in REVIEW_CHECKS
    ]
    statuses = {status for _, status, _ in results}
    status = FAIL if FAIL in statuses else PASS if PASS in statuses else NOT_RUN
    return status, "; ".join(f"({label}) {s}: {figure}" for label, s, figure in results)


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
    ("cuda_graph review (a)-(e)", "a CUDA GPU, torch >= 2.11 (else --simulate)", graph_review),
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
