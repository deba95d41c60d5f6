"""``cuda_graph=`` reviewed against what a real GPU does (issue 53's review): what the
first captured steps were let through by the model or told the user wrongly, each
proven on the modeled H100 (``timed_runtime`` + ``modeled_cuda``) before its fix.

- Copies captured into a graph are not timed: CUDA's ``elapsed_time`` of an event
  recorded during a capture fails (cudaErrorInvalidValue), and the model now says so.
- A layer whose shapes change under ``cuda_graph=`` is told what the graph needs, not
  to pass ``retain_pinned_cpu_buffers=False`` (which it never passed).
- Before torch 2.11 a capture cannot allocate pinned memory: the pool says to run an
  eager step first, instead of CUDA failing inside torch's host allocator.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_graph_steps import StaticStep, squared_loss, step
from helpers import modeled_device

from cpu_offload import get_cpu_offload_context
from cpu_offload.errors import CpuOffloadError
from cpu_offload.graphs import graph_synchronizer
from cpu_offload.report.copy_timer import CopyTimer
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.cuda_graphs import CaptureError
from cpu_offload.testing.modeled_cuda import modeled_cuda

H, L, K = 256, 4, 2


def blocks() -> torch.nn.ModuleList:
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(H, H, device="meta"), torch.nn.GELU()) for _ in range(L)
    )


def activations(rows: int = 1024) -> torch.Tensor:
    return torch.empty(rows, H, device="cuda", requires_grad=True)


def test_an_event_recorded_in_a_capture_has_no_elapsed_time():
    """The model's rule (CUDA: cudaErrorInvalidValue); eager events and events recorded
    again after the capture keep theirs."""
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        x = torch.empty(1024, 1024, device="cuda")
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        x.mul_(2)
        end.record()
        torch.cuda.synchronize()
        assert start.elapsed_time(end) > 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            start.record()
            x.mul_(2)
            end.record()
        graph.replay()
        torch.cuda.synchronize()
        with pytest.raises(CaptureError) as raised:
            start.elapsed_time(end)
        start.record()
        end.record()
        torch.cuda.synchronize()
        assert start.elapsed_time(end) >= 0
    assert raised.value.kind == "cudaErrorInvalidValue"
    assert "a captured record marks no time" in str(raised.value)


def test_the_copy_timer_times_eager_copies_and_skips_captured_ones():
    """A benchmark's copy timer on a context whose step is captured: before the fix it
    recorded timing events in the capture, and ``bandwidth()`` then failed."""
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        synchronizer = ctx.offload_synchronizer
        timer = synchronizer.copy_timer = CopyTimer(synchronizer.backend)
        layers, x = blocks(), activations()
        step(layers, x, ctx, sync_fn)  # eager warm-up: timed
        eager_spans = len(timer.spans)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(layers, x, ctx, sync_fn)
        graph.replay()
        torch.cuda.synchronize()
        assert len(timer.spans) == eager_spans == 2 * K  # a d2h and an h2d per layer
        assert timer.bandwidth("d2h") is not None and timer.bandwidth("h2d") is not None


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_layer_whose_shapes_change_is_told_what_its_buffers_need(cuda_graph):
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        if cuda_graph:
            ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        else:
            ctx, sync_fn = get_cpu_offload_context(
                True, K, L, min_offload_numel=0, retain_pinned_cpu_buffers=True
            )
        layers = blocks()
        step(layers, activations(1024), ctx, sync_fn)
        with pytest.raises(CpuOffloadError) as raised:
            step(layers, activations(512), ctx, sync_fn)
    message = str(raised.value)
    assert "layer 0 saved tensors with other (shape, stride, dtype)" in message
    assert "expected [((1024, 256), (256, 1), torch.float32)" in message
    assert "found [((512, 256), (256, 1), torch.float32)" in message
    if cuda_graph:
        assert message.startswith("cpu_offload: cuda_graph= keeps each offloaded layer's")
        assert "Keep shapes fixed between steps, as a CUDA graph replays one shape" in message
        assert "retain_pinned_cpu_buffers" not in message  # the user never passed it
    else:
        assert message.startswith("cpu_offload: retain_pinned_cpu_buffers=True keeps")
        assert "or pass retain_pinned_cpu_buffers=False." in message


def capture_without_warmup() -> Any:
    """A step captured with no eager step before it: its pinned buffers are allocated
    during the capture; the gradients exist already, as a graph's do."""
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        layers, x = blocks(), activations()
        for parameter in layers.parameters():
            parameter.grad = torch.zeros_like(parameter)
        x.grad = torch.zeros_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(layers, x, ctx, sync_fn)
        graph.replay()
        torch.cuda.synchronize()
    return ctx


def test_a_capture_allocates_pinned_buffers_where_torch_can():
    ctx = capture_without_warmup()
    assert ctx.offload_synchronizer.host_memory_stats()["num_host_alloc"] > 0
    assert ctx.report().cuda_graph.replay


def test_before_torch_2_11_a_capture_that_needs_pinned_buffers_says_to_warm_up(monkeypatch):
    """torch before 2.11 cannot allocate pinned memory in a capture (its host allocator
    queries events and calls cudaHostAlloc, which a capture refuses): the pool says so
    before asking, and what to do."""
    monkeypatch.setattr(graph_synchronizer, "PINNED_IN_CAPTURE", False)
    with pytest.raises(CpuOffloadError) as raised:
        capture_without_warmup()
    message = str(raised.value)
    assert message.startswith("cpu_offload: cuda_graph=: layer 0 needs new pinned host buffers")
    assert f"torch {torch.__version__} cannot allocate pinned memory" in message
    assert "Run one eager step with the same shapes before the capture" in message


def test_before_torch_2_11_a_warmed_up_capture_allocates_nothing_and_replays(monkeypatch):
    monkeypatch.setattr(graph_synchronizer, "PINNED_IN_CAPTURE", False)
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        layers, x = blocks(), activations()
        step(layers, x, ctx, sync_fn)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(layers, x, ctx, sync_fn)
        moved = run.live.timeline.copied["d2h"]
        graph.replay()
        torch.cuda.synchronize()
        assert run.live.timeline.copied["d2h"] > moved
    assert ctx.report().host_allocations == 0 and ctx.report().cuda_graph.replay


@pytest.mark.parametrize("scope", [True, "layer"])
def test_an_eager_pass_in_flight_across_a_replay_keeps_its_offloaded_values(scope):
    """An eager forward's offloaded layers wait on the host while the captured step is
    replayed, then its backward runs (a step outside the graph interleaved with
    replays, an evaluation pass kept for later): the replay's copies must not write
    into the eager pass's host buffers.  Data mode: the eager pass's input gradient
    equals the one computed without offload."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        for _ in range(L)
    )
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 32, generator=generator) for _ in range(3)]
    leaf = xs[1].clone().requires_grad_()
    want = squared_loss(model, leaf)
    want.backward()
    want_grad, leaf.grad = leaf.grad, None
    captured = StaticStep(model, xs[0].shape)
    with timed_runtime(modeled_device(), data=True) as run:
        live = run.live
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=scope)
        captured.ctx, captured.sync_fn = ctx, sync_fn
        captured.load(xs[0])
        captured()
        graph = live.CUDAGraph()
        with live.graph(graph, stream=live.Stream()):
            captured()
        loss = squared_loss(model, leaf, ctx, sync_fn)  # eager, its offloaded layers on the host
        captured.load(xs[2])
        graph.replay()
        loss.backward()
        live.synchronize()
    assert torch.equal(loss.detach(), want.detach())
    assert torch.equal(leaf.grad, want_grad)


def reloaded_on_compute_popped_on_another_stream(capturing: bool) -> int:
    """A backward in two parts: down to layer 1's output on compute (which starts the
    reloads of layers 0 and 1 there), the rest on another stream, which pops them;
    compute then allocates again.  ``capturing``: the offloader is told its stream is
    captured (the flag faked, the work run, so the allocator's reuse checks run: a
    capture bakes in the same reuse, and PyTorch's allocator honours ``record_stream``
    during a capture by keeping the block out of the capture's reuse)."""
    layers = [torch.nn.Linear(512, 512, device="meta") for _ in range(L)]
    x = torch.empty(1024, 512, device="meta", requires_grad=True)
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        backend = ctx.offload_synchronizer.backend
        h, outputs = x, []
        for layer in layers:
            with ctx:
                h = layer(h).relu()
            h = sync_fn(h)
            outputs.append(h)
        backend.wrapped.is_capturing = lambda: capturing
        (grad,) = torch.autograd.grad(h.sum(), outputs[1])
        other = torch.cuda.Stream()
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            outputs[1].backward(grad)
        backend.wrapped.is_capturing = lambda: False
        for _ in range(4):
            torch.empty(1024, 512, device="cuda").fill_(0)
    return run.block_reuses


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "captured"])
def test_a_reloaded_tensor_popped_on_another_stream_is_recorded_for_it_under_capture(capturing):
    """Before the fix ``CaptureBackend`` dropped ``record_stream`` while capturing: the
    reloaded blocks went back to compute's pool while the other stream (and the copy it
    waited for) still used them."""
    assert reloaded_on_compute_popped_on_another_stream(capturing) > 0
