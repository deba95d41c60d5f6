"""CUDA graphs on the modeled accelerator (NOTE [Modeled CUDA graphs]): capture records,
replay re-issues on the clocks, and capture refuses what CUDA and PyTorch refuse."""

from __future__ import annotations

import pytest
import torch
from helpers import modeled_device

from cpu_offload.testing import StreamHazardError, timed_runtime
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


def test_an_event_recorded_in_a_capture_is_refused_outside_it_until_recorded_again():
    x, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            x @ w
            done = torch.cuda.current_stream().record_event()
        for use in (
            lambda: torch.cuda.current_stream().wait_event(done),
            done.synchronize,
            done.query,
        ):
            with pytest.raises(CaptureError, match="from outside that capture") as caught:
                use()
            assert caught.value.kind == "cudaErrorCapturedEvent"
            assert "Event(external=True)" in str(caught.value)
        with pytest.raises(CaptureError) as caught:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.cuda.current_stream().wait_event(done)  # another capture's
        assert caught.value.__context__.kind == "cudaErrorCapturedEvent"
        done.record()  # outside: an ordinary event again
        done.synchronize()


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


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def captured_step(live, model, static_x, host, join_before_reload=True):
    """A training step, its first layer's output through pinned host memory on a copy
    stream, captured on a side stream; returns the graph."""
    side, copy = live.Stream(), live.Stream()
    g = live.CUDAGraph()
    with live.graph(g, stream=side):
        for parameter in model.parameters():
            parameter.grad.zero_()
        h = model[0](static_x)
        copy.wait_stream(side)
        with live.stream(copy):
            host.copy_(h, non_blocking=True)
        if join_before_reload:
            side.wait_stream(copy)
        back = torch.empty_like(h)
        back.copy_(host, non_blocking=True)
        side.wait_stream(copy)
        model[2](model[1](back)).square().sum().backward()
    return g, h


def test_a_captured_training_step_replayed_in_the_data_mode_computes_what_eager_does():
    model = mlp()
    xs = [torch.randn(8, 32) for _ in range(3)]
    expected = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        expected.append([p.grad.clone() for p in model.parameters()])
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with timed_runtime(DEVICE, data=True) as run:
        live = run.live
        static_x, host = torch.zeros(8, 32), torch.full((8, 64), 7.0, pin_memory=True)
        g, h = captured_step(live, model, static_x, host)
        with live.graph(live.CUDAGraph(), stream=live.Stream()):
            host.add_(1.0)  # host work runs at capture, as on a device, and stays
        assert (host == 8.0).all()
        host.sub_(1.0)
        # capture ran nothing: older memory as it was, its own tensors poison
        assert h.isnan().all() and (host == 7.0).all()
        assert all(not p.grad.any() for p in model.parameters())
        assert live.timeline.copied["d2h"] == 0
        got = []
        for x in xs:
            static_x.copy_(x)
            g.replay()
            got.append([p.grad.clone() for p in model.parameters()])
        moved = live.timeline.copied["d2h"]
    assert moved == 3 * 8 * 64 * 4
    for want, have in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(want, have))


def test_a_missing_wait_inside_the_graph_is_a_hazard_at_replay():
    model = mlp()
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with timed_runtime(DEVICE, data=True) as run:
        static_x, host = torch.randn(8, 32), torch.empty(8, 64, pin_memory=True)
        g, _ = captured_step(run.live, model, static_x, host, join_before_reload=False)
        with pytest.raises(StreamHazardError, match="queued copy into it had not run"):
            g.replay()


def test_the_offloaders_default_mode_sees_the_capture_and_refuses_it():
    from cpu_offload import get_cpu_offload_context
    from cpu_offload.engine.layer_context import CAPTURE_REFUSED
    from cpu_offload.errors import CpuOffloadError

    x, w = inputs()
    with timed_runtime(DEVICE) as run:
        ctx, _ = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
        with pytest.raises(CpuOffloadError) as raised:
            with run.live.graph(run.live.CUDAGraph(), stream=run.live.Stream()):
                with ctx:
                    x @ w
    assert str(raised.value) == CAPTURE_REFUSED


def test_the_reuse_checks_see_replays_not_the_capture():
    _, w = inputs()
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        x = torch.empty(2 * H, H, device="cuda")  # compute's
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x @ w  # read on the capture stream, which runs nothing
        g.replay()  # on compute: compute's own work
        del x
        torch.empty(2 * H, H, device="cuda")  # takes x's block: ordered, no hazard
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y = torch.empty(2 * H, H, device="cuda")  # the side stream's
        with torch.cuda.graph(g2 := torch.cuda.CUDAGraph()):
            y @ w
        g2.replay()  # compute reads y, which the side stream owns
        del y
        with pytest.raises(StreamHazardError, match=f"compute's replay of graph {g2.number}"):
            with torch.cuda.stream(side):
                torch.empty(2 * H, H, device="cuda")
