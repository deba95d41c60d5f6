"""The link between device and host, measured: raw pinned copies of one large buffer.

``python -m cpu_offload.check``, the benchmark and a memory budget's plan (which assumes
the link's bandwidth) all measure it here, with the device's own backend.
"""

from __future__ import annotations

import statistics

import torch

from .backend import DeviceBackend

__all__ = ["measure_ceiling"]


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
