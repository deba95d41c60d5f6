"""Measuring one mode, and the raw copy ceiling of the link."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device import DeviceBackend
from .modes import Mode

__all__ = ["ModeResult", "measure_ceiling", "measure_mode"]


@dataclass
class ModeResult:
    """Everything measured for one mode (bytes, milliseconds, bytes per second)."""

    mode: str
    skipped: str | None = None
    step_ms: list[float] = field(default_factory=list)
    median_step_ms: float | None = None
    spread_ms: tuple[float, float] | None = None  # (min, max) over measured steps
    overhead_pct: float | None = None
    baseline_bytes: int | None = None  # allocated before the forward pass
    end_of_forward_bytes: int | None = None
    peak_bytes: int | None = None
    analytic_end_of_forward_bytes: int | None = None
    memory_saved_bytes: int | None = None  # against "none", at the end of forward
    bytes_offloaded_per_step: int | None = None
    d2h_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    pinned_allocations_per_step: float | None = None
    host_syncs_per_step: float | None = None
    memory_trace: list[tuple[str, int, int | None]] = field(default_factory=list)


def _step(
    mode: Mode, layers: Any, x: torch.Tensor, backend: DeviceBackend, trace: list | None
) -> tuple[float, int | None, int | None, int | None]:
    """One forward and backward; (ms, baseline, end-of-forward, peak) bytes."""
    layers.zero_grad(set_to_none=True)
    backend.synchronize()
    backend.reset_peak_memory_stats()
    baseline = backend.memory_allocated()
    start, end = backend.timing_event(), backend.timing_event()
    start.record(backend.current_stream())
    counter = [0]

    def boundary(out: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        if trace is not None:
            layer = counter[0] - 1
            trace.append(("forward", layer, backend.memory_allocated()))
            if out.grad_fn is not None:
                out.grad_fn.register_prehook(
                    lambda _: trace.append(("backward", layer, backend.memory_allocated()))
                )
        return out

    out = mode.forward(layers, x, boundary)
    end_of_forward = backend.memory_allocated()
    out.float().square().mean().backward()
    end.record(backend.current_stream())
    backend.synchronize()
    return start.elapsed_time(end), baseline, end_of_forward, backend.max_memory_allocated()


def measure_mode(
    mode: Mode, layers: Any, inputs: list[torch.Tensor], backend: DeviceBackend, warmup: int
) -> ModeResult:
    result = ModeResult(mode.name, skipped=mode.skip_reason)
    if mode.skip_reason:
        return result
    for x in inputs[:warmup]:
        _step(mode, layers, x, backend, None)
    pool = mode.synchronizer.host_buffers if mode.synchronizer is not None else None
    allocations = pool.allocations if pool is not None else 0
    offloaded = mode.synchronizer.stats.bytes_offloaded if mode.synchronizer else 0
    if mode.copy_timer is not None:
        mode.copy_timer.reset()
    measured = inputs[warmup:]
    with backend.count_host_syncs() as syncs:
        for index, x in enumerate(measured):
            trace = result.memory_trace if index == len(measured) - 1 else None
            ms, baseline, end_of_forward, peak = _step(mode, layers, x, backend, trace)
            result.step_ms.append(ms)
    result.baseline_bytes, result.end_of_forward_bytes, result.peak_bytes = (
        baseline,
        end_of_forward,
        peak,
    )
    result.median_step_ms = statistics.median(result.step_ms)
    result.spread_ms = (min(result.step_ms), max(result.step_ms))
    steps = len(measured)
    if syncs is not None:
        result.host_syncs_per_step = syncs[0] / steps
    if mode.synchronizer is not None:
        result.bytes_offloaded_per_step = (
            mode.synchronizer.stats.bytes_offloaded - offloaded
        ) // steps
        result.pinned_allocations_per_step = (pool.allocations - allocations) / steps
    if mode.copy_timer is not None:
        result.d2h_bytes_per_s = mode.copy_timer.bandwidth("d2h")
        result.h2d_bytes_per_s = mode.copy_timer.bandwidth("h2d")
    return result


def measure_ceiling(backend: DeviceBackend, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Raw pinned copies of one large buffer on a side stream: bytes per second."""
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
    host_buffer = backend.empty_host(device_buffer)
    stream = backend.new_stream()
    figures = {}
    for direction, dst, src in (
        ("d2h", host_buffer, device_buffer),
        ("h2d", device_buffer, host_buffer),
    ):
        times = []
        for _ in range(repeats + 1):
            backend.synchronize()
            # The buffers were allocated on the compute stream: wait for it first.
            backend.wait_stream(stream, backend.current_stream())
            start, end = backend.timing_event(), backend.timing_event()
            start.record(stream)
            backend.copy(dst, src, stream)
            end.record(stream)
            backend.synchronize()
            times.append(start.elapsed_time(end))
        figures[direction] = nbytes / (statistics.median(times[1:]) / 1e3)
    return figures
