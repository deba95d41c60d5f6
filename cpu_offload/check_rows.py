"""The rows of ``check --full`` that run the offloader in this process (NOTE [The first hour
on a GPU] in check_full.py): reloads in slices, on demand and tensor by tensor against the
plain policy; the host pool against torch's pinned allocator; layers compiled with
``fullgraph=True``.

NOTE [Reloads against the plain policy]
    One stack of Llama-3-8B layers (the llama8b-layer preset's 8 layers, bf16, at
    sequence :data:`SEQ`, as the peers' rows run it), the first :data:`OFFLOADED`
    offloaded, runs a training step four ways: the plain policy (each layer reloaded
    whole, its tensors let go one by one as autograd's use of each ends: NOTE [Reloaded
    tensors go one by one]); the same with every reloaded tensor held to the layer's
    end, as the layers did before (the baseline of the one-by-one release); reloaded in
    64 MiB slices (NOTE [Reloading a layer in slices]); and with layer 0's slices
    brought on demand (NOTE [Slices at the peak]).  Each is a step's peak device memory
    (what the step allocated, less the parameters and input) and its step time.  PASS
    when the one-by-one release peaks lower than the hold, the slices lower than the
    plain policy, layer 0 on demand lower than the slices (at 8k the slice it would
    prefetch is at the step's peak; at 4k it is not), and the sliced steps take at most
    :data:`SLICED_STEP_FACTOR` of the plain one (a sliced layer's copies are exposed in
    its own backward: docs/benchmarks.md).  On a device: warm-up steps, then the median
    step and the highest peak; under ``--simulate``: one step on the modeled
    accelerator, shapes only (modeled H100: 6.18, 6.67, 4.39 and 4.20 GiB; 453, 453,
    534 and 544 ms).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from .device.runtime import (
    deterministic_algorithms,
    get_backend,
    graph_runtime,
    pinned_memory_stats,
)
from .engine.layer_state import OffloadableLayerState
from .layer_hooks import offload_layers
from .models.llama import LlamaConfig, LlamaLayer
from .models.presets import MODEL_PRESETS

__all__ = ["compiled_blocks", "cuda_graph", "host_pool", "reloads"]

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
MIB, GIB = 2**20, 2**30
OFFLOADED, SEQ = 6, 8192
SLICE_BYTES = 64 * MIB
#: a step with sliced (or on-demand) reloads may take this factor of the plain policy's
SLICED_STEP_FACTOR = 1.5
WARMUP, STEPS = 2, 5


@contextlib.contextmanager
def layers_hold_their_reloads() -> Iterator[None]:
    """Every reloaded tensor held until its layer's backward ends, as before NOTE [Reloaded
    tensors go one by one]: the baseline that the one-by-one release is measured against."""
    pop = OffloadableLayerState.pop_leased

    def pop_and_hold(state: Any, lease: Any, index: int, prefetch: bool = True) -> Any:
        tensor = pop(state, lease, index, prefetch)
        state._data.reloaded[index] = tensor
        return tensor

    OffloadableLayerState.pop_leased = pop_and_hold  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        OffloadableLayerState.pop_leased = pop  # type: ignore[method-assign]


def _llama_stack(device: str) -> tuple[nn.ModuleList, torch.Tensor]:
    preset: dict[str, Any] = MODEL_PRESETS["llama8b-layer"]
    shape = LlamaConfig(
        preset["hidden"], preset["heads"], preset["kv_heads"], preset["ffn"], preset["layers"]
    )
    torch.manual_seed(0)
    with torch.device(device):
        layers = nn.ModuleList(LlamaLayer(shape) for _ in range(shape.layers))
        x = torch.randn(preset["batch"], SEQ, shape.hidden)
    return layers.to(torch.bfloat16), x.to(torch.bfloat16).requires_grad_()


def _no_gradients(layers: nn.ModuleList, x: torch.Tensor) -> None:
    for tensor in [x, *layers.parameters()]:
        tensor.grad = None


def _train_step(layers: nn.ModuleList, x: torch.Tensor) -> None:
    h = x.clone()  # the stack's input, as an embedding makes it
    for layer in layers:
        h = layer(h)
    h.float().square().mean().backward()


def _modeled(profile: str, layers: nn.ModuleList, x: torch.Tensor, hold: bool, **options: Any):
    """One step under ``offload_layers`` on the modeled ``profile``: (step s, peak bytes)."""
    from .testing import timed_runtime

    around = layers_hold_their_reloads() if hold else contextlib.nullcontext()
    _no_gradients(layers, x)
    with timed_runtime(profile, record=False) as run, around, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = offload_layers(layers, OFFLOADED, **options)
        try:
            _train_step(layers, x)
        finally:
            handle.remove()
    return run.step_s, run.peak_bytes


def _measured(device: str, layers: nn.ModuleList, x: torch.Tensor, hold: bool, **options: Any):
    """Warm-up steps then :data:`STEPS` on the device: (median step s, highest peak of what
    a step allocated)."""
    backend = get_backend(device)
    around = layers_hold_their_reloads() if hold else contextlib.nullcontext()
    times, peaks = [], []
    with around, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = offload_layers(layers, OFFLOADED, **options)
        try:
            for index in range(WARMUP + STEPS):
                _no_gradients(layers, x)  # each step allocates them, as the model counts
                backend.synchronize()
                before = backend.memory_allocated() or 0
                backend.reset_peak_memory_stats()
                start = time.perf_counter()
                _train_step(layers, x)
                backend.synchronize()
                if index >= WARMUP:
                    times.append(time.perf_counter() - start)
                    peaks.append((backend.max_memory_allocated() or 0) - before)
        finally:
            handle.remove()
    return statistics.median(times), max(peaks)


def reloads(device: str, simulate: str | None) -> tuple[str, str]:
    """NOTE [Reloads against the plain policy]."""
    if not simulate and device == "cpu":
        return NOT_RUN, "peak device memory needs a GPU or NPU (else --simulate)"
    layers, x = _llama_stack("meta" if simulate else device)
    slices = {"reload_slice_bytes": SLICE_BYTES}
    ways: dict[str, tuple[bool, dict[str, Any]]] = {
        "plain": (False, {}),
        "held to the layer's end": (True, {}),
        "64 MiB slices": (False, slices),
        "layer 0 on demand": (False, {**slices, "reload_on_demand_layers": [0]}),
    }
    figures = {}
    for name, (hold, options) in ways.items():
        if simulate:
            figures[name] = _modeled(simulate, layers, x, hold, **options)
        else:
            figures[name] = _measured(device, layers, x, hold, **options)
    (plain_s, plain), (_, held), (sliced_s, sliced), (demand_s, demand) = figures.values()
    limit = SLICED_STEP_FACTOR * plain_s
    criteria = [
        ("one by one not below the hold", plain < held),
        ("slices not below the plain policy", sliced < plain),
        ("on demand not below the slices", demand < sliced),
        (f"sliced step over {SLICED_STEP_FACTOR}x the plain", sliced_s <= limit),
        (f"on-demand step over {SLICED_STEP_FACTOR}x the plain", demand_s <= limit),
    ]
    failed = [what for what, holds in criteria if not holds]
    shown = "; ".join(f"{n}: {b / GIB:.2f} GiB, {s * 1e3:.1f} ms" for n, (s, b) in figures.items())
    figure = f"k={OFFLOADED} of 8 at {SEQ // 1024}k, peak and step: {shown}"
    return (FAIL, f"{figure} ({', '.join(failed)})") if failed else (PASS, figure)


POOL_WIDTH, POOL_HIDDEN, POOL_BLOCKS, POOL_ROWS, POOL_STEPS = 1024, 3000, 6, 4096, 4
#: the most the pool may hold, as torch holds it, per byte a step moves (issue 51)
POOL_FACTOR = 1.10


def _pool_steps(device: str, held: Callable[[], Any]) -> tuple[list[dict[str, Any]], Any]:
    """6 x Linear(1024, 3000) + GELU + Linear(3000, 1024), k=4, 4096 rows, 4 steps: each
    step's ``report().to_dict()``, and what ``held`` reads after the last step (the pool
    still alive)."""
    torch.manual_seed(0)
    with torch.device(device):
        layers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(POOL_WIDTH, POOL_HIDDEN), nn.GELU(), nn.Linear(POOL_HIDDEN, POOL_WIDTH)
            )
            for _ in range(POOL_BLOCKS)
        )
        x = torch.randn(POOL_ROWS, POOL_WIDTH, requires_grad=True)
    reports = []
    handle = offload_layers(layers, 4)
    try:
        for _ in range(POOL_STEPS):
            h = x
            for layer in layers:
                h = layer(h)
            h.sum().backward()
            reports.append(handle.report().to_dict())
        found = held()
    finally:
        handle.remove()
    return reports, found


def host_pool(device: str, simulate: str | None) -> tuple[str, str]:
    """The host pool against torch's pinned allocator (NOTE [Pinned sizes as torch holds
    them]): what the pool counts (``host_reserved_bytes``) is what torch holds
    (``host_memory_stats()``, or the modeled allocator under ``--simulate``), within
    :data:`POOL_FACTOR` of a step's moved bytes, with no pinned allocation after step 1."""
    if simulate:
        from .testing import timed_runtime

        with timed_runtime(simulate, record=False) as run:
            reports, _ = _pool_steps("meta", lambda: None)
        held, allocations = run.pinned_reserved_bytes, run.pinned_allocations
    else:
        before = pinned_memory_stats(device) if device != "cpu" else None
        if before is None:
            return NOT_RUN, f"torch's pinned allocator reports nothing on {device}"
        get_backend(device).empty_host_cache()
        before = pinned_memory_stats(device) or {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # k = 4 of 6 on small layers: copies exposed
            reports, after = _pool_steps(device, lambda: pinned_memory_stats(device) or {})
        held = after["allocated_bytes.current"] - before["allocated_bytes.current"]
        allocations = after["num_host_alloc"] - before["num_host_alloc"]
    own = max(report["host_reserved_bytes"] for report in reports)
    moved = reports[-1]["moved_bytes"]
    per_step = [report["host_allocations"] for report in reports]
    figure = (
        f"the pool holds {own / MIB:.1f} MiB, torch {held / MIB:.1f} MiB, "
        f"{own / moved:.2f}x of {moved / MIB:.1f} MiB moved; pinned allocations per step "
        f"{per_step}, torch's {allocations}"
    )
    holds = own == held <= POOL_FACTOR * moved and sum(per_step[1:]) == 0
    return (PASS if holds and allocations == sum(per_step) else FAIL), figure


class _Stack(nn.Module):
    def __init__(self, shape: LlamaConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(LlamaLayer(shape) for _ in range(shape.layers))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return h


def _gradients(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def compiled_blocks(device: str, simulate: str | None) -> tuple[str, str]:
    """Each layer compiled in place with ``fullgraph=True`` (torchtitan's
    ``apply_compile``), ``offload_layers`` first: two steps' gradients bit-identical to
    the same compiled program without offload, bytes moved (docs/integrations.md).  On
    the device given (the CPU under ``--simulate``: the modeled accelerator's dispatch
    mode compiles nothing), with inductor on an accelerator and aot_eager on the CPU
    (inductor's CPU rows are tests/compile's), deterministic kernels, torch on one thread
    on the CPU."""
    where = "cpu" if simulate else device
    on_cpu = where == "cpu"
    shape = LlamaConfig(64, 4, 2, 172, 4) if on_cpu else LlamaConfig(1024, 8, 2, 2816, 4)
    seq, dtype = (32, torch.float32) if on_cpu else (2048, torch.bfloat16)
    compiler = "aot_eager" if on_cpu else "inductor"
    threads = torch.get_num_threads()
    if on_cpu:
        torch.set_num_threads(1)  # one thread: the CPU's kernels are deterministic
    torch._dynamo.reset()
    try:
        reference = _Stack(shape).to(where, dtype)
        model = copy.deepcopy(reference)
        handle = offload_layers(model, 2, min_offload_numel=0)
        for stack in (reference, model):
            for layer in stack.layers:
                layer.compile(backend=compiler, fullgraph=True)
        inputs = [
            torch.randn(2, seq, shape.hidden, generator=torch.Generator().manual_seed(seed))
            for seed in (1, 2)
        ]
        inputs = [x.to(where, dtype) for x in inputs]
        with deterministic_algorithms():  # flash attention's backward is not, by default
            expected = [_gradients(reference, x) for x in inputs]
            actual = [_gradients(model, x) for x in inputs]
        stats = handle.offload_synchronizer.stats
        handle.remove()
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    same = all(
        len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
        for want, got in zip(expected, actual)
    )
    moved = stats.bytes_offloaded / stats.forward_passes if stats.forward_passes else 0
    figure = (
        f"4 Llama layers (hidden {shape.hidden}, seq {seq}, {str(dtype)[6:]}), fullgraph=True, "
        f"{compiler} on {where}, k=2: gradients of 2 steps "
        f"{'bit-identical to' if same else 'DIFFER from'} the compiled program without "
        f"offload; {moved / MIB:.2f} MiB offloaded per step"
    )
    return (PASS if same and stats.forward_passes == 2 and moved > 0 else FAIL), figure


GRAPH_WIDTH, GRAPH_ROWS, GRAPH_LAYERS, GRAPH_REPLAYS = 1024, 4096, 4, 3


def _graph_blocks(width: int) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(
            nn.Linear(width, 4 * width, device="cuda"),
            nn.GELU(),
            nn.Linear(4 * width, width, device="cuda"),
        )
        for _ in range(GRAPH_LAYERS)
    )


def _graphed_step(layers: nn.ModuleList, x: torch.Tensor) -> None:
    h = x
    for layer in layers:
        h = h + layer(h)
    h.float().square().mean().backward()


def _replays(cuda: Any, layers: nn.ModuleList, x: torch.Tensor, moved: Callable[[], Any]):
    """``offload_layers(cuda_graph=True)``: an eager step, a step captured, then
    :data:`GRAPH_REPLAYS` replays; per replay, the gradients and the bytes ``moved``
    (d2h, h2d) says it moved; and the handle's report."""
    handle = offload_layers(layers, GRAPH_LAYERS // 2, min_offload_numel=0, cuda_graph=True)
    tensors = [x, *layers.parameters()]
    try:
        _graphed_step(layers, x)  # the warm-up: host buffers allocated
        for tensor in tensors:  # the gradients: the graph's outputs, from its pool
            tensor.grad = None
        graph = cuda.CUDAGraph()
        with cuda.graph(graph):
            _graphed_step(layers, x)
        found = []
        for _ in range(GRAPH_REPLAYS):
            (d2h, h2d) = moved()
            graph.replay()
            cuda.synchronize()
            (d2h_after, h2d_after) = moved()
            grads = [cast(torch.Tensor, t.grad).clone() for t in tensors]
            found.append((grads, (d2h_after - d2h, h2d_after - h2d)))
        report = handle.report().to_dict()
    finally:
        handle.remove()
    return found, report


def cuda_graph(device: str, simulate: str | None) -> tuple[str, str]:
    """A whole step captured with ``cuda_graph=True`` and replayed 3 times: on a GPU, each
    replay's gradients bit-identical to the eager step's without offload; under
    ``--simulate``, shapes only under ``modeled_cuda``, each replay moving what an eager
    step moves (NOTE [Modeled CUDA graphs])."""
    if simulate:
        from .testing import timed_runtime
        from .testing.modeled_cuda import modeled_cuda

        with timed_runtime(simulate, flavour="cuda", record=False) as run:
            live: Any = run.live
            with modeled_cuda(live):
                cuda, copied = graph_runtime("cuda"), live.timeline.copied
                x = torch.empty(GRAPH_ROWS, GRAPH_WIDTH, device="cuda", requires_grad=True)
                layers = _graph_blocks(GRAPH_WIDTH)
                handle = offload_layers(layers, GRAPH_LAYERS // 2, min_offload_numel=0)
                _graphed_step(layers, x)  # eager, offloaded without cuda_graph
                cuda.synchronize()
                handle.remove()
                eager = (copied["d2h"], copied["h2d"])
                moved = lambda: (copied["d2h"], copied["h2d"])  # noqa: E731
                found, report = _replays(cuda, layers, x, moved)
        per_replay = [bytes_moved for _, bytes_moved in found]
        holds = per_replay == [eager] * GRAPH_REPLAYS and eager[0] > 0
        figure = (
            f"{GRAPH_LAYERS} MLP blocks of {GRAPH_WIDTH}, k=2, modeled: each of "
            f"{GRAPH_REPLAYS} replays moved {per_replay[0][0] / MIB:.1f} MiB out and "
            f"{per_replay[0][1] / MIB:.1f} MiB back (an eager step: {eager[0] / MIB:.1f}, "
            f"{eager[1] / MIB:.1f})"
        )
        captured = report["cuda_graph/captured"] == report["cuda_graph/replay"] == 1
        return (PASS if holds and captured else FAIL), figure
    cuda = graph_runtime(device)
    if cuda is None or device == "cpu":
        return NOT_RUN, f"{device} captures no graphs (else --simulate)"
    with torch.device(device), deterministic_algorithms():
        torch.manual_seed(1)
        x = torch.randn(GRAPH_ROWS, GRAPH_WIDTH, requires_grad=True)
        layers = _graph_blocks(GRAPH_WIDTH)
        reference = copy.deepcopy(layers)
        y = x.detach().clone().requires_grad_()
        _graphed_step(reference, y)  # eager, without offload
        expected = [cast(torch.Tensor, t.grad) for t in [y, *reference.parameters()]]
        found, report = _replays(cuda, layers, x, lambda: (0, 0))
    same = [all(torch.equal(a, b) for a, b in zip(expected, got)) for got, _ in found]
    figure = (
        f"{GRAPH_LAYERS} MLP blocks of {GRAPH_WIDTH}, k=2, a step captured: gradients of "
        f"{GRAPH_REPLAYS} replays bit-identical to eager without offload: {same}; "
        f"{report['copied_bytes'] / MIB:.1f} MiB copied per step"
    )
    return (PASS if all(same) and report["cuda_graph/replay"] == 1 else FAIL), figure
