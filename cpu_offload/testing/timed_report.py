"""What a modeled run found: step time, where the compute stream's time went, memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..device.profiles import DeviceProfile
from .clocks import StreamClock
from .device_memory import MemoryMark

__all__ = ["LiveRun", "TimedReport"]

GIB = 2**30


class LiveRun(Protocol):
    """What a report asks of its run while the block runs (``timed_device.TimedRuntime``)."""

    def mark(self, label: str, not_counted: Iterable[Any]) -> MemoryMark: ...

    def begin(self, phase: str) -> None: ...


@dataclass
class TimedReport:
    """The figures of one run under :func:`~cpu_offload.testing.timed_runtime`, filled in
    when the block ends (times in seconds, memory in bytes).

    Attributes:
        profile: the device modeled.
        flavour: the runtime modeled (``"cuda"``, ``"npu"``).
        device: the device tensors of the run live on (meta when shapes only).
        data: whether the run computed real data (under the strict simulator).
        step_s: when the last work of the block completed, from its start.
        compute_s: time the compute stream ran kernels.
        exposed_copy_s: time the compute stream waited for copies on other streams, or
            ran copies itself.
        host_bound_s: time the compute stream idled because the host had not issued
            its next kernel (a launch-bound step, or a host stalled in a synchronisation).
        host_sync_s: time the host stalled in synchronisations and pageable copies.
        host_syncs: synchronising calls.
        d2h_bytes, h2d_bytes: bytes copied each way.
        peak_bytes: the most device memory allocated at once, everything the block
            allocated counted (gradients and temporaries too).
        end_bytes: device memory still allocated when the block ended.
        host_peak_bytes: the most host memory (pinned or pageable) the block's own
            allocations held at once.
        marks: memory at the points the program marked (:meth:`mark`).
        curve: ``(time, bytes allocated)`` at every change.
        streams: the streams' clocks and logs, the compute stream first.
        host_log: ``(start, end, what)`` of each host stall.
        pinned_reserved_bytes: the most pinned memory torch's caching host allocator held
            (power-of-two rounding, cached free blocks: NOTE [Modeled pinned memory]).
        pinned_allocations: the pinned blocks it had to make (``cudaHostAlloc`` calls).
        block_reuses: allocations that took a freed block of their stream's pool, each
            checked against other streams' work on the old tensor (NOTE [Allocator reuse
            across streams]).
    """

    profile: DeviceProfile
    flavour: str
    device: torch.device
    data: bool
    step_s: float = 0.0
    compute_s: float = 0.0
    exposed_copy_s: float = 0.0
    host_bound_s: float = 0.0
    host_sync_s: float = 0.0
    host_syncs: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    host_peak_bytes: int = 0
    block_reuses: int = 0
    pinned_reserved_bytes: int = 0
    pinned_allocations: int = 0
    marks: list[MemoryMark] = field(default_factory=list, repr=False)
    curve: list[tuple[float, int]] = field(default_factory=list, repr=False)
    streams: list[StreamClock] = field(default_factory=list, repr=False)
    host_log: list[tuple[float, float, str]] = field(default_factory=list, repr=False)
    #: the run, while the block runs
    live: LiveRun | None = field(default=None, repr=False)

    def _run(self, what: str) -> LiveRun:
        if self.live is None:
            raise RuntimeError(
                f"TimedReport.{what}: the modeled run has ended; call it inside the "
                "`with timed_runtime(...)` block."
            )
        return self.live

    def mark(self, label: str, not_counted: Iterable[Any] = ()) -> MemoryMark:
        """Note device memory now, less the memory of the ``not_counted`` tensors (a
        layer's output on its way to the next layer, parameter gradients, ...): what
        :attr:`counted_peak_bytes` compares."""
        return self._run("mark").mark(label, not_counted)

    def begin(self, phase: str) -> None:
        """Name the part of the step that starts now (``"forward 3"``): the work issued
        from here on is shown under that name in traces and plots."""
        self._run("begin").begin(phase)

    @property
    def counted_peak_bytes(self) -> int:
        """The most memory counted at any mark (0 without marks)."""
        return max((m.counted for m in self.marks), default=0)

    def counted_at(self, label: str) -> int:
        """The memory counted at the last mark named ``label``."""
        for mark in reversed(self.marks):
            if mark.label == label:
                return mark.counted
        raise KeyError(f"TimedReport.counted_at: no mark {label!r}.")

    @property
    def compute(self) -> StreamClock:
        return self.streams[0]

    def summary(self) -> str:
        """One line of the figures."""
        return (
            f"{self.profile.name} ({self.flavour}, modeled): step {self.step_s * 1e3:.3f} ms, "
            f"compute {self.compute_s * 1e3:.3f} ms, exposed copies "
            f"{self.exposed_copy_s * 1e3:.3f} ms, host-bound {self.host_bound_s * 1e3:.3f} ms, "
            f"{self.host_syncs} host syncs ({self.host_sync_s * 1e3:.3f} ms); D2H "
            f"{self.d2h_bytes / GIB:.3f} GiB, H2D {self.h2d_bytes / GIB:.3f} GiB; peak "
            f"{self.peak_bytes / GIB:.3f} GiB"
        )
