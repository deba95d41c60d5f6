"""Streams and events of the modeled accelerator (NOTE [Modeled clocks] in clocks.py).

A :class:`TimedStream` is a ``torch.Stream`` (so that ``Tensor.record_stream`` accepts
it) with a clock; a :class:`TimedEvent` carries the time at which the work before it
completes.  In the data mode of ``timed_runtime`` each also drives a stream or event of
the strict simulator (``inner``), so every hazard of NOTE [Strict stream simulation]
still raises.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch

from ..device.backend import HostTimingEvent
from .allocator_pools import StreamOrder
from .clocks import StreamClock, Timeline

__all__ = ["Runtime", "TimedEvent", "TimedStream"]


class Runtime(Protocol):
    """What streams and events ask of the runtime they belong to (``timed_device.py``)."""

    timeline: Timeline
    current: TimedStream
    order: StreamOrder

    def Event(self, enable_timing: bool = False) -> TimedEvent: ...  # noqa: N802

    def wait_event(self, stream: TimedStream, event: TimedEvent) -> None: ...

    def host_wait(self, time: float, what: str) -> None: ...


_ids = itertools.count(1 << 20)  # stream ids of their own (record_stream names streams by id)


class TimedStream(torch.Stream):
    """A stream of the modeled accelerator.

    Attributes:
        runtime: the runtime it belongs to.
        clock: its clock.
        inner: the strict simulator's stream it drives, in the data mode (else None).
    """

    def __new__(cls, runtime: Runtime, clock: StreamClock, inner: Any = None) -> TimedStream:
        return super().__new__(cls, stream_id=next(_ids), device_type=0, device_index=0)

    def __init__(self, runtime: Runtime, clock: StreamClock, inner: Any = None) -> None:
        self.runtime = runtime
        self.clock = clock
        self.inner = inner

    def wait_event(self, event: TimedEvent) -> None:  # type: ignore[override]
        self.runtime.wait_event(self, event)

    def wait_stream(self, stream: TimedStream) -> None:  # type: ignore[override]
        event = self.runtime.Event()
        event.record(stream)
        self.runtime.wait_event(self, event)

    def record_event(self, event: TimedEvent | None = None) -> TimedEvent:  # type: ignore[override]
        event = event if event is not None else self.runtime.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        what = f"{self.clock.name}.synchronize()"
        if self.runtime.timeline.capture is not None:
            self.runtime.timeline.capture.sync(what, self.clock)
        self.runtime.host_wait(self.clock.time, what)
        self.runtime.order.host_saw(self.runtime.order.stamp(self.clock))
        if self.inner is not None:
            self.inner.synchronize()

    def query(self) -> bool:
        if self.runtime.timeline.capture is not None:
            self.runtime.timeline.capture.sync(f"{self.clock.name}.query()", self.clock)
        return self.clock.time <= self.runtime.timeline.host

    def __repr__(self) -> str:
        return f"TimedStream({self.clock.name}, at {self.clock.time * 1e3:.3f} ms)"


class TimedEvent:
    """An event of the modeled accelerator: the stream it was recorded on, and when the
    work before it completes.

    Args:
        runtime: the runtime it belongs to.
        inner: the strict simulator's event it drives, in the data mode (else None).
        external: ``Event(external=True)``: captured as record and wait nodes of a graph,
            which may cross a capture's boundary (NOTE [Modeled CUDA graphs]).
    """

    def __init__(self, runtime: Runtime, inner: Any = None, external: bool = False) -> None:
        self.runtime = runtime
        self.inner = inner
        self.external = external
        self.captured: tuple[Any, int] | None = None  # (capture, record) when recorded in one
        self.stream: TimedStream | None = None
        self.time = 0.0
        self.stamp: dict[Any, int] = {}  # what work completes before it (StreamOrder)

    def record(self, stream: TimedStream | None = None) -> None:
        stream = stream if stream is not None else self.runtime.current
        capture = self.runtime.timeline.capture
        if capture is not None and capture.record(self, stream.clock):
            return  # a point of the graph: the event's own time is left as it was
        self.captured = None
        self.stream = stream
        self.time = self.runtime.timeline.now(stream.clock)
        self.stamp = self.runtime.order.stamp(stream.clock)
        if self.inner is not None:
            self.inner.record(stream.inner)

    def synchronize(self) -> None:
        if self.runtime.timeline.capture is not None:
            self.runtime.timeline.capture.event_sync("event.synchronize()", self)
        elif self.captured is not None:  # recorded in a capture that has ended
            raise self.captured[0].used_after("event.synchronize()")
        self.runtime.host_wait(self.time, "event.synchronize()")
        self.runtime.order.host_saw(self.stamp)
        if self.inner is not None:
            self.inner.synchronize()

    def query(self) -> bool:
        if self.runtime.timeline.capture is not None:
            self.runtime.timeline.capture.event_sync("event.query()", self)
        elif self.captured is not None:  # recorded in a capture that has ended
            raise self.captured[0].used_after("event.query()")
        return self.stream is None or self.time <= self.runtime.timeline.host

    def elapsed_time(self, end: TimedEvent) -> float:
        """Milliseconds from this event to ``end``; refused for an event last recorded
        in a capture (a graph's edge, with no time of its own)."""
        for event in (self, end):
            if event.captured is not None:
                raise event.captured[0].untimed()
        return HostTimingEvent.elapsed_time(self, end)  # type: ignore[arg-type]
