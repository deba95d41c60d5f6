"""Measuring one mode, and the raw copy ceiling of the link."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device.backend import DeviceBackend
from .modes import Mode

__all__ = ["ModeResult", "measure_ceiling", "measure_modes"]


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


class _Measurement:
    """What one mode has measured so far, between interleaved steps."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.result = ModeResult(mode.name, skipped=mode.skip_reason)
        self.syncs: int | None = 0
        self.allocations = 0
        self.offloaded = 0

    def start(self) -> None:
        """Called after warmup: counters start from here."""
        synchronizer = self.mode.synchronizer
        self.allocations = _allocations(self.mode)
        if synchronizer is not None:
            self.offloaded = synchronizer.stats.bytes_offloaded
        if self.mode.copy_timer is not None:
            self.mode.copy_timer.reset()


def _allocations(mode: Mode) -> int:
    return mode.synchronizer.host_buffers.allocations if mode.synchronizer is not None else 0


def measure_modes(
    modes: list[Mode],
    layers: Any,
    inputs: list[torch.Tensor],
    backend: DeviceBackend,
    warmup: int,
    max_warmup: int = 20,
    progress: Any = None,
) -> list[ModeResult]:
    """Measure every mode on the same inputs, interleaved: one step of each in turn.

    Each mode warms up for ``warmup`` steps and then until a step allocates no host
    buffer (at most ``max_warmup`` steps), so that measured steps are steady ones.
    Interleaving spreads slow phases of the machine over every mode alike.
    """
    running = [_Measurement(mode) for mode in modes]
    live = [m for m in running if not m.result.skipped]
    for measurement in live:
        mode = measurement.mode
        for step in range(max_warmup):
            before = _allocations(mode)
            _step(mode, layers, inputs[step % len(inputs)], backend, None)
            if step + 1 >= warmup and _allocations(mode) == before:
                break
        measurement.start()
        if progress is not None:
            progress(mode.name)
    for index, x in enumerate(inputs):
        last = index == len(inputs) - 1
        for measurement in live:
            mode, result = measurement.mode, measurement.result
            with backend.count_host_syncs() as syncs:
                ms, baseline, end_of_forward, peak = _step(
                    mode, layers, x, backend, result.memory_trace if last else None
                )
            result.step_ms.append(ms)
            if syncs is None or measurement.syncs is None:
                measurement.syncs = None
            else:
                measurement.syncs += syncs[0]
            if last:
                result.baseline_bytes = baseline
                result.end_of_forward_bytes = end_of_forward
                result.peak_bytes = peak
    steps = len(inputs)
    for measurement in live:
        mode, result = measurement.mode, measurement.result
        result.median_step_ms = statistics.median(result.step_ms)
        result.spread_ms = (min(result.step_ms), max(result.step_ms))
        if measurement.syncs is not None:
            result.host_syncs_per_step = measurement.syncs / steps
        if mode.synchronizer is not None:
            offloaded = mode.synchronizer.stats.bytes_offloaded - measurement.offloaded
            result.bytes_offloaded_per_step = offloaded // steps
            allocated = _allocations(mode) - measurement.allocations
            result.pinned_allocations_per_step = allocated / steps
        if mode.copy_timer is not None:
            result.d2h_bytes_per_s = mode.copy_timer.bandwidth("d2h")
            result.h2d_bytes_per_s = mode.copy_timer.bandwidth("h2d")
    return [m.result for m in running]


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
