"""Timing of the offloader's copies, for bandwidth figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..device.backend import DeviceBackend

__all__ = ["CopyTimer"]


@dataclass
class _Span:
    direction: str  # "d2h" or "h2d"
    nbytes: int
    start: Any
    end: Any


class CopyTimer:
    """Records timing events around each layer's copies on the offload stream.

    Set ``synchronizer.copy_timer = CopyTimer(synchronizer.backend)`` before a forward
    pass; read :meth:`bandwidth` after the device is synchronized.  Copies captured
    into a CUDA graph are not timed (an event recorded during a capture has no time:
    CUDA's ``elapsed_time`` of it fails).
    """

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.spans: list[_Span] = []

    def start(self, stream: Any) -> Any:
        """A timing event recorded on ``stream``, or None while the stream is captured."""
        if self.backend.is_capturing():
            return None
        event = self.backend.timing_event()
        event.record(stream)
        return event

    def stop(self, direction: str, nbytes: int, start: Any, stream: Any) -> None:
        if start is None:  # captured: not timed
            return
        end = self.backend.timing_event()
        end.record(stream)
        self.spans.append(_Span(direction, nbytes, start, end))

    def totals(self, direction: str) -> tuple[int, float]:
        """Bytes and seconds of all copies in ``direction`` ("d2h" or "h2d")."""
        spans = [s for s in self.spans if s.direction == direction]
        seconds = sum(s.start.elapsed_time(s.end) for s in spans) / 1e3
        return sum(s.nbytes for s in spans), seconds

    def bandwidth(self, direction: str) -> float | None:
        """Bytes per second over the recorded copies, or ``None`` without any."""
        nbytes, seconds = self.totals(direction)
        return nbytes / seconds if nbytes and seconds > 0 else None

    def reset(self) -> None:
        self.spans.clear()
