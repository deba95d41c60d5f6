"""CUDA graphs on the modeled accelerator (NOTE [Modeled CUDA graphs]): capture records,
replay re-issues on the clocks, and capture refuses what CUDA and PyTorch refuse."""

from __future__ import annotations

import pytest
import torch
from helpers import modeled_device

from cpu_offload.testing import timed_runtime
from cpu_offload.testing.cuda_graphs import CaptureError
from cpu_offload.testing.modeled_cuda import modeled_cuda

DEVICE = modeled_device()
H = 1024


def offload_and_back(x, w, host):
    """A layer, its output copied to pinned host memory on a side stream joined to the
    current one, and copied back: the work a graph captures."""
    main = torch.cuda.current_stream()
    y = (x @ w).relu()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        host.copy_(y, non_blocking=True)
    main.wait_stream(side)
    return host.to("cuda", non_blocking=True) * 2


def inputs():
    return torch.empty(2 * H, H, device="meta"), torch.empty(H, H, device="meta")


def test_replay_moves_and_takes_what_eager_does_and_capture_advances_nothing():
    x, w = inputs()
    with timed_runtime(DEVICE) as eager, modeled_cuda(eager.live):
        offload_and_back(x, w, torch.empty(2 * H, H, pin_memory=True))
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        live = run.live
        host = torch.empty(2 * H, H, pin_memory=True)
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        host_time = live.timeline.host
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            out = offload_and_back(x, w, host)
        assert not torch.cuda.is_current_stream_capturing()
        # capture ran nothing: no clock moved, no byte moved
        assert live.timeline.host == host_time
        assert all(c.time == c.busy_s == 0.0 for c in live.timeline.streams)
        assert live.timeline.copied == {"d2h": 0, "h2d": 0, "d2d": 0}
        held = live.memory_allocated()
        assert held == 3 * 2 * H * H * 4  # the pool's reserve: mm, relu, and the copy back
        steps = []
        for _ in range(3):
            start, busy = live.compute.clock.time, live.compute.clock.busy_s
            g.replay()
            steps.append((live.compute.clock.time - start, live.compute.clock.busy_s - busy))
            assert live.memory_allocated() == held  # replay allocates nothing
        assert out.shape == (2 * H, H) and out.is_cuda
    assert run.d2h_bytes == run.h2d_bytes == 3 * eager.d2h_bytes == 3 * 2 * H * H * 4
    for elapsed, busy in steps:  # as the eager run of the same work, less its host issues
        assert busy == pytest.approx(eager.compute_s, rel=1e-9)
        assert elapsed == pytest.approx(eager.step_s, rel=1e-3)
    assert run.host_syncs == eager.host_syncs + 2  # torch.cuda.graph's synchronize, ours
    assert run.peak_bytes == held


def test_the_runtime_exposes_capture_to_the_backend_without_modeled_cuda():
    x, w = inputs()
    with timed_runtime(DEVICE) as run:
        live = run.live
        backend = live.backend()
        g = live.CUDAGraph()
        side = live.Stream()
        with live.graph(g, stream=side):
            assert backend.is_capturing() and live.is_current_stream_capturing()
            y = x @ w
            fork = live.Stream()
            with live.stream(fork):
                assert not backend.is_capturing()
                fork.wait_stream(side)
                assert backend.is_capturing()  # it joined the capture
                y.relu_()
            side.wait_stream(fork)
        assert not backend.is_capturing()
        g.replay()
        g.replay()
        busy = live.compute.clock.busy_s
    assert y.shape == (2 * H, H)
    matmul = DEVICE.kernel_seconds(2 * 2 * H * H * H, 3 * 2 * H * H * 4)
    assert busy == pytest.approx(2 * matmul)  # the forked stream's relu ran on its branch
    assert len(run.streams) == 4  # compute, side, fork, the graph's branch for the fork
    assert run.streams[3].busy_s == pytest.approx(2 * DEVICE.kernel_seconds(0, 2 * 2 * H * H * 4))


def test_graphs_share_a_pool_and_reset_gives_it_back():
    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        pool = torch.cuda.graph_pool_handle()
        first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(first, pool=pool):
            y = x @ w
        with torch.cuda.graph(second, pool=pool):
            del y  # its block goes back to the pool, which the second capture reuses
            z = x @ w
        assert first.pool() == second.pool() == pool
        assert run.live.memory_allocated() == 2 * H * H * 4
        first.reset()
        assert run.live.memory_allocated() == 2 * H * H * 4  # the second graph holds it
        second.reset()
        del z
        assert run.live.memory_allocated() == 0
        with pytest.raises(RuntimeError, match="nothing captured"):
            first.replay()


def capture_raising(body, mode="global"):
    """Capture ``body()`` in a graph; the exception it raises."""
    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(CaptureError) as caught:
            with torch.cuda.graph(g, capture_error_mode=mode):
                body(x, w)
        assert not torch.cuda.is_current_stream_capturing()
    return caught.value


def invalidated_by(error, kind, what):
    """``error`` is capture_end's, after ``kind`` (saying ``what``) invalidated it."""
    assert error.kind == "cudaErrorStreamCaptureInvalidated", error
    assert isinstance(error.__context__, CaptureError) and error.__context__.kind == kind
    assert what in str(error.__context__) and kind in str(error.__context__)
    assert kind in str(error)
    return error.__context__


def test_a_value_read_during_capture_is_refused_and_invalidates_it():
    def body(x, w):
        (x @ w).sum().item()

    first = invalidated_by(capture_raising(body), "cudaErrorStreamCaptureUnsupported", "item()")
    assert "before capture_begin or after capture_end" in str(first)


@pytest.mark.parametrize(
    "sync",
    [
        ("torch.cuda.synchronize()", lambda: torch.cuda.synchronize()),
        ("synchronize()", lambda: torch.cuda.current_stream().synchronize()),
        ("query()", lambda: torch.cuda.current_stream().query()),
    ],
    ids=["device", "stream", "stream query"],
)
def test_a_synchronisation_during_capture_is_refused(sync):
    what, call = sync
    error = capture_raising(lambda x, w: call())
    invalidated_by(error, "cudaErrorStreamCaptureUnsupported", what)


def test_an_events_synchronize_or_query_is_refused_and_a_captured_one_says_so():
    outside = []

    def body(x, w):
        outside[0].synchronize()

    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        outside.append(torch.cuda.Event())
        outside[0].record()
        g = torch.cuda.CUDAGraph()
        with pytest.raises(CaptureError) as caught:
            with torch.cuda.graph(g):
                outside[0].query()
        invalidated_by(caught.value, "cudaErrorStreamCaptureUnsupported", "event.query()")
        with pytest.raises(CaptureError, match="cudaErrorCapturedEvent.*recorded in the capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.cuda.current_stream().record_event().synchronize()
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="relaxed"):
            outside[0].synchronize()  # relaxed: it waits for nothing captured


def test_a_copy_with_pageable_host_memory_is_refused_as_pytorch_refuses_it():
    def body(x, w):
        pageable = torch.empty(H, H, device="cpu")
        pageable.to("cuda", non_blocking=True)

    error = capture_raising(body)
    assert isinstance(error, RuntimeError)
    assert error.kind == "pytorch#172156 unpinned copy during capture"
    assert "h2d copy with pageable host memory" in str(error) and "pin_memory=True" in str(error)
    assert error.__context__ is None  # refused before it was issued: the capture stays valid

    def back(x, w):
        (x @ w).cpu()

    assert "d2h copy with pageable" in str(capture_raising(back))


def test_a_wait_for_an_event_recorded_outside_the_capture_is_isolation():
    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        before = torch.cuda.current_stream().record_event()
        external = torch.cuda.Event(external=True)
        external.record()
        g = torch.cuda.CUDAGraph()
        with pytest.raises(CaptureError) as caught:
            with torch.cuda.graph(g):
                torch.cuda.current_stream().wait_event(before)
        isolation = invalidated_by(
            caught.value, "cudaErrorStreamCaptureIsolation", "recorded outside the capture"
        )
        assert "on compute" in str(isolation)
        with torch.cuda.graph(g):  # an external event may cross the boundary
            torch.cuda.current_stream().wait_event(external)
            x @ w
        g.replay()


def test_work_on_the_default_stream_during_capture_is_implicit():
    def body(x, w):
        with torch.cuda.stream(torch.cuda.default_stream()):
            x @ w

    invalidated_by(capture_raising(body), "cudaErrorStreamCaptureImplicit", "default stream")


def test_a_side_stream_that_did_not_join_may_not_touch_the_captures_memory():
    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        host = torch.empty(2 * H, H, pin_memory=True)
        side = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with pytest.raises(CaptureError, match="did not join the capture") as caught:
            with torch.cuda.graph(g):
                y = x @ w
                with torch.cuda.stream(side):  # no side.wait_stream(capture stream)
                    host.copy_(y, non_blocking=True)
        assert caught.value.kind == "uncaptured work on captured memory"
        assert "allocated" in str(caught.value) and "wait_stream" in str(caught.value)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            with torch.cuda.stream(side):
                w.mul_(2)  # not the capture's memory: runs eagerly, as CUDA runs it
        assert run.live.timeline.copied["d2h"] == 0


def test_a_side_stream_left_unjoined_at_the_end_is_refused():
    def body(x, w):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x @ w  # no capture_stream.wait_stream(side) after

    error = capture_raising(body)
    assert error.kind == "cudaErrorStreamCaptureUnjoined"
    assert "never waited for" in str(error) and "wait_stream(side)" in str(error)


def test_an_allocation_outside_the_graphs_pool_is_refused_unless_relaxed():
    def body(x, w):
        with torch.cuda.stream(torch.cuda.Stream()):  # not capturing
            torch.empty(H, device="cuda")

    error = invalidated_by(
        capture_raising(body), "cudaErrorStreamCaptureUnsupported", "which is not capturing"
    )
    assert "cudaMalloc" in str(error)
    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="relaxed"):
            with torch.cuda.stream(torch.cuda.Stream()):
                kept = torch.empty(H, device="cuda")
        assert run.live.memory_allocated() == H * 4 and kept.is_cuda


def test_capture_on_the_default_stream_is_refused():
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        with pytest.raises(RuntimeError, match="the current stream is the default stream"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.default_stream()):
                pass


def test_make_graphed_callables_runs_torchs_own_code_on_the_model():
    module = torch.nn.Sequential(
        torch.nn.Linear(H, H, device="meta"), torch.nn.ReLU(), torch.nn.Linear(H, H, device="meta")
    )
    sample = torch.empty(2 * H, H, device="meta", requires_grad=True)
    with timed_runtime(DEVICE) as eager, modeled_cuda(eager.live):
        module(torch.empty(2 * H, H, device="cuda", requires_grad=True)).sum().backward()
    for parameter in module.parameters():
        parameter.grad = None
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        live = run.live
        graphed = torch.cuda.make_graphed_callables(module, (sample,), num_warmup_iters=2)
        assert graphed is module and live.memory_allocated() > 0  # the pool's reserve
        syncs = live.timeline.host_syncs
        steps, held = [], []
        for _ in range(3):
            busy, copied = live.compute.clock.busy_s, dict(live.timeline.copied)
            x = torch.empty(2 * H, H, device="cuda", requires_grad=True)
            graphed(x).sum().backward()
            steps.append(live.compute.clock.busy_s - busy)
            held.append(live.memory_allocated())
            assert live.timeline.copied == copied
        assert live.timeline.host_syncs == syncs  # the steps synchronise nothing
    # each step replays the forward and the backward graph: the eager step's kernels
    # (less the static inputs' copies, which the meta device's data_ptr of 0 skips)
    assert steps[1] == pytest.approx(steps[2])
    assert steps[1] == pytest.approx(eager.compute_s, rel=0.02)
    assert held[1] == held[2]  # steady state: nothing new allocated
    assert all(p.grad is not None and p.grad.shape == p.shape for p in module.parameters())
