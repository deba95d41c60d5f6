"""The modeled accelerator: clocks, copies, events, synchronisation, the allocator's count."""

from __future__ import annotations

import pytest
import torch
from helpers import forward, make_input, make_layers, modeled_device, without_event_waits

from cpu_offload import get_cpu_offload_context
from cpu_offload.device.runtime import StreamBackend, get_backend
from cpu_offload.testing import StreamHazardError, timed_runtime
from cpu_offload.testing.trace import trace_events

MIB = 2**20
DEVICE = modeled_device()


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def test_a_kernel_takes_its_roofline_after_the_host_issued_it():
    a, b = meta(1024, 1024), meta(1024, 1024)
    with timed_runtime(DEVICE) as run:
        a @ b  # 2.1 GFLOP, 12 MiB: bound by FLOPs
        a * 2  # 8 MiB read and written: bound by bytes
    matmul = DEVICE.kernel_seconds(2 * 1024**3, 3 * 4 * MIB)
    elementwise = DEVICE.kernel_seconds(0, 8 * MIB)
    assert run.compute_s == pytest.approx(matmul + elementwise)
    assert run.step_s == pytest.approx(DEVICE.host_issue_s + matmul + elementwise)
    assert run.host_bound_s == pytest.approx(DEVICE.host_issue_s)  # the first kernel's wait


def test_a_dtype_conversion_is_a_kernel_and_a_move_to_the_host_a_copy():
    x = meta(MIB // 4)
    with timed_runtime(DEVICE) as run:
        x.to(torch.float16)  # reads 1 MiB, writes 0.5 MiB
        x.to("meta", torch.float16)  # the same, on the same device
        x.to("cpu", torch.float16)  # a copy to pageable host memory
    assert run.compute_s == pytest.approx(2 * DEVICE.kernel_seconds(0, MIB + MIB // 2))
    assert run.d2h_bytes == MIB and run.host_syncs == 1


def test_a_launch_bound_step_shows_as_one():
    x = meta(16)
    with timed_runtime(DEVICE) as run:
        for _ in range(100):
            x = x + 1
    assert run.step_s == pytest.approx(100 * DEVICE.host_issue_s + DEVICE.launch_s, rel=0.01)
    assert run.host_bound_s > 0.4 * run.step_s


def test_copies_overlap_compute_and_each_direction_has_its_engine():
    with timed_runtime(DEVICE) as run:
        backend = get_backend()
        assert isinstance(backend, StreamBackend) and backend.device == torch.device("meta")
        out_stream, in_stream = backend.new_stream(), backend.new_stream()
        device = torch.empty(MIB // 4, device="meta")
        host = backend.empty_host(device)  # pinned host memory, as a meta tensor
        back = torch.empty_like(device)
        backend.wait_stream(out_stream, backend.current_stream())
        backend.copy(host, device, out_stream)  # D2H
        backend.copy(back, backend.empty_host(device), in_stream)  # H2D: another engine
        backend.copy(meta(MIB // 4), device, out_stream)  # device to device
    copy = MIB / DEVICE.d2h + DEVICE.launch_s
    assert run.d2h_bytes == run.h2d_bytes == MIB
    assert run.step_s == pytest.approx(copy + DEVICE.kernel_seconds(0, 2 * MIB), rel=0.01)
    assert run.exposed_copy_s == 0  # the compute stream never waited


def test_one_engine_runs_one_copy_at_a_time_and_waits_expose_copies():
    with timed_runtime(DEVICE) as run:
        backend = get_backend()
        first, second = backend.new_stream(), backend.new_stream()
        device = [torch.empty(MIB // 4, device="meta") for _ in range(2)]
        for stream, tensor in zip((first, second), device):
            backend.copy(backend.empty_host(tensor), tensor, stream)  # both D2H
        backend.wait_event(backend.current_stream(), backend.record_event(second))
        start, end = backend.timing_event(), backend.timing_event()
        start.record(first)
        end.record(second)
    copy = MIB / DEVICE.d2h + DEVICE.launch_s
    assert run.exposed_copy_s == pytest.approx(2 * copy, rel=0.01)  # the second queued
    assert start.elapsed_time(end) == pytest.approx(1e3 * copy, rel=0.01)


def test_a_pageable_copy_and_a_synchronisation_stall_the_host():
    with timed_runtime(DEVICE) as run:
        device = meta(MIB // 4)
        host = device.to("cpu")  # pageable memory, synchronous for the host
        stream = get_backend().new_stream()
        with run.live.stream(stream):  # type: ignore[union-attr]
            torch.empty_like(host, device="meta").copy_(host)
        get_backend().synchronize()  # counted, and nothing left to wait for
    assert run.host_syncs == 3
    assert run.host_sync_s == pytest.approx(2 * MIB / DEVICE.pageable, rel=0.01)
    assert run.h2d_bytes == run.d2h_bytes == MIB


def test_the_cuda_flavour_reports_synchronisations_and_the_npu_flavour_does_not():
    for flavour, expected in (("cuda", 2), ("npu", None)):
        with timed_runtime(DEVICE, flavour=flavour):
            backend = get_backend()
            with backend.count_host_syncs() as syncs:
                backend.synchronize()
                backend.record_event().synchronize()
        assert (syncs if syncs is None else syncs[0]) == expected


def test_the_npu_flavour_stages_a_non_contiguous_copy_through_pageable_memory():
    with timed_runtime(DEVICE, flavour="npu") as run:
        backend = get_backend()
        device = meta(256, 1024).t()[::2]  # neither contiguous nor dense
        host = torch.empty(device.shape, device="cpu", pin_memory=True)
        backend.copy(host, device, backend.new_stream())
    assert run.host_syncs == 1 and run.host_sync_s > 0


def test_memory_is_allocated_at_issue_and_freed_with_its_last_reference():
    with timed_runtime(DEVICE) as run:
        a = torch.empty(MIB // 4, device="meta")
        b = a * 2
        run.mark("two", [])
        del a
        run.mark("one", [])
        view = b[:10]
        del b
        run.mark("a view holds it", [view])
        del view
        run.mark("none", [])
    assert [m.allocated for m in run.marks] == [2 * MIB, MIB, MIB, 0]
    assert [m.counted for m in run.marks] == [2 * MIB, MIB, 0, 0]
    assert run.peak_bytes == 2 * MIB and run.end_bytes == 0
    assert run.counted_at("one") == MIB and run.counted_peak_bytes == 2 * MIB


def test_a_recorded_block_comes_back_once_the_host_sees_its_stream_done():
    with timed_runtime(DEVICE) as run:
        backend = get_backend()
        stream = backend.new_stream()
        block = torch.empty(MIB // 4, device="meta")
        backend.copy(backend.empty_host(block), block, stream)
        block.record_stream(stream)
        del block  # the copy runs for a millisecond still
        run.mark("freed, recorded", [])
        small = torch.empty(16, device="meta")  # an allocation polls the recorded blocks
        run.mark("polled too early", [])
        backend.synchronize()
        run.mark("synchronized", [])
    assert [m.allocated for m in run.marks] == [MIB, MIB + 512, 512]
    del small


def test_a_report_is_read_after_its_block():
    with timed_runtime(DEVICE) as run:
        pass
    with pytest.raises(RuntimeError, match="TimedReport.mark: the modeled run has ended"):
        run.mark("late")
    assert run.step_s == 0 and "test device" in run.summary()


def test_offload_through_stream_backend_on_the_model_hides_copies_behind_compute():
    layers = make_layers("mlp", 4, 256, torch.float32).to("meta")
    x = torch.empty(4096, 256, device="meta", requires_grad=True)
    with timed_runtime(DEVICE) as run:
        ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
        run.begin("forward")
        out = forward(layers, x, ctx, sync_fn)
        run.begin("backward")
        out.sum().backward()
    assert run.d2h_bytes == run.h2d_bytes > 0 and run.exposed_copy_s > 0
    events = trace_events(run, "k=2")
    names = {e["name"] for e in events} | {e["args"].get("name") for e in events if "args" in e}
    assert {"forward", "backward", "compute", "device memory", "k=2"} <= names
    assert any(e["name"].startswith("D2H") and e["ph"] == "X" for e in events)
    assert any(e["name"].startswith("wait for") for e in events)  # the exposed copies


def test_the_data_mode_keeps_every_hazard_of_the_strict_simulator(monkeypatch):
    without_event_waits(monkeypatch, "pop_leased")
    layers = make_layers("mlp", 4, 32, torch.float32)
    with pytest.raises(StreamHazardError, match="a wait for the copy's event is missing"):
        with timed_runtime(DEVICE, data=True):
            ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
            x = make_input("mlp", 32, torch.float32, 0).requires_grad_()
            forward(layers, x, ctx, sync_fn).sum().backward()


def test_the_data_mode_computes_what_autograd_computes():
    layers = make_layers("mlp", 4, 32, torch.float32)
    x = make_input("mlp", 32, torch.float32, 0).requires_grad_()
    forward(layers, x).sum().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)
    with timed_runtime(DEVICE, data=True) as run:
        ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
        forward(layers, x, ctx, sync_fn).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(layers.parameters(), expected))
    assert run.data and run.device == torch.device("cpu") and run.d2h_bytes > 0
