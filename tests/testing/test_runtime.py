"""The simulated runtime: torch.cuda's surface on the strict simulator, CUDA and NPU flavours."""

from __future__ import annotations

import pytest
import torch
from helpers import forward, make_input, make_layers, without_event_waits

from cpu_offload import get_cpu_offload_context
from cpu_offload.device.runtime import StreamBackend, get_backend
from cpu_offload.report.copy_timer import CopyTimer
from cpu_offload.testing import SimulatedRuntime, StreamHazardError, strict_runtime


def test_get_backend_is_the_stream_backend_on_the_simulated_runtime():
    with strict_runtime("cuda") as runtime:
        backend = get_backend()
        assert isinstance(backend, StreamBackend)
        assert backend.device == torch.device("cpu") and not backend.pin_memory
        assert backend.current_stream() is runtime.sim.compute


def test_a_copy_under_a_side_stream_is_queued_until_waited_for():
    with strict_runtime("cuda") as runtime:
        backend = runtime.backend()
        stream = backend.new_stream()
        src, dst = torch.arange(4.0), torch.zeros(4)
        backend.wait_stream(stream, backend.current_stream())
        backend.copy(dst, src, stream)
        assert runtime.sim.queued_copies() == 1
        backend.wait_event(backend.current_stream(), backend.record_event(stream))
        assert runtime.sim.queued_copies() == 0 and torch.equal(dst, src)


def test_a_missing_ready_wait_is_a_hazard():
    with strict_runtime("cuda") as runtime:
        backend = runtime.backend()
        src = torch.arange(4.0) * 2  # written by compute the side stream never waited for
        with pytest.raises(StreamHazardError, match="before that stream waited"):
            backend.copy(torch.empty(4), src, backend.new_stream())


def test_only_copies_run_on_a_side_stream():
    with strict_runtime("cuda") as runtime:
        with runtime.stream(runtime.Stream()):
            with pytest.raises(StreamHazardError, match="runs only copies and allocations on side"):
                torch.ones(3).mul_(2)


def test_a_reload_used_without_its_wait_is_a_hazard(monkeypatch):
    """StreamBackend reports no handoffs: the compute that reads the tensor catches it."""
    without_event_waits(monkeypatch, "pop_leased")
    layers = make_layers("mlp", 4, 32, torch.float32)
    with pytest.raises(StreamHazardError, match="a wait for the copy's event is missing"):
        with strict_runtime("cuda"):
            ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
            x = make_input("mlp", 32, torch.float32, 0).requires_grad_()
            forward(layers, x, ctx, sync_fn).sum().backward()


def test_cuda_flavour_counts_synchronisations_npu_cannot():
    with strict_runtime("cuda") as runtime:
        runtime.set_sync_debug_mode("error")
        with runtime.backend().count_host_syncs() as syncs:
            runtime.synchronize()
        assert syncs == [1] and runtime.get_sync_debug_mode() == 2
        with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
            runtime.synchronize()
        runtime.set_sync_debug_mode("default")
    with strict_runtime("npu") as runtime:
        with runtime.backend().count_host_syncs() as syncs:
            runtime.synchronize()
        assert syncs is None


def test_timing_events_measure_elapsed_time():
    runtime = SimulatedRuntime()
    start, end = runtime.Event(enable_timing=True), runtime.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="both events must be recorded"):
        start.elapsed_time(end)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0.0


def test_unknown_flavour():
    with pytest.raises(ValueError, match="flavour must be one of \\('cuda', 'npu'\\), got 'xla'"):
        SimulatedRuntime("xla")


def test_copy_timing_and_memory_statistics_through_the_stream_backend():
    with strict_runtime("cuda") as runtime:
        backend = runtime.backend()
        ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
        timer = ctx.offload_synchronizer.copy_timer = CopyTimer(backend)
        layers = make_layers("mlp", 3, 32, torch.float32)
        x = make_input("mlp", 32, torch.float32, 0).requires_grad_()
        backend.reset_peak_memory_stats()
        forward(layers, x, ctx, sync_fn).sum().backward()
        backend.synchronize()
        assert timer.totals("d2h")[0] == timer.totals("h2d")[0] > 0
        assert timer.bandwidth("d2h") is not None
        assert backend.device_type == "cpu" and backend.runtime_type == "cuda"
        # The simulator keeps no allocator statistics: zeros, not None.
        assert (backend.memory_allocated(), backend.max_memory_allocated()) == (0, 0)
