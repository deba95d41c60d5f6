"""The clocks of a modeled accelerator: one per stream, one for the host, and the copy engines.

NOTE [Modeled clocks]
    A stream's clock is the time its work issued so far completes.  The host clock is
    the time the host has reached in the program; issuing a kernel or a copy costs it
    the profile's ``host_issue_s``, and a kernel starts no earlier than it was issued
    and than the work before it on its stream completed.  A kernel then takes its
    roofline time (``DeviceProfile.kernel_seconds``).  A copy also waits for its
    engine: device-to-host and host-to-device are two engines, each running one copy
    at a time, at the pinned or the pageable rate; a pageable copy holds the host until
    it completes, as the CUDA runtime does.  An event carries the time at which the work
    before it completes; a stream that waits for one moves its clock to that time, and
    a host synchronisation moves the host clock to the time it waits for.

    What the compute stream does with its time is counted: kernels (``busy_s``), waits
    for other streams (``waited_s``: the exposed copy time, with the copies it runs
    itself, ``copy_s``) and idling because the host had not issued the next kernel yet
    (``host_bound_s``: a launch-bound step, or a host stalled in a synchronisation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..device.profiles import DeviceProfile

__all__ = ["ENGINES", "StreamClock", "Timeline"]

#: the copy engines: device-to-host and host-to-device run independently
ENGINES = ("d2h", "h2d")


@dataclass(eq=False)
class StreamClock:
    """A stream's clock and what it spent its time on (seconds).

    Attributes:
        name: how the trace names the stream.
        is_compute: the stream compute work runs on (the current stream).
        time: when the work issued so far on the stream completes.
        busy_s: time spent running kernels.
        copy_s: time spent running copies.
        waited_s: time spent waiting for events of other streams.
        host_bound_s: time idle because the host had not issued the next work.
        log: ``(start, end, kind, what, phase)`` of each kernel, copy and wait, where
            the timeline records (``kind`` is ``"kernel"``, ``"d2h"``, ``"h2d"``,
            ``"d2d"`` or ``"wait"``; ``what`` the operator, the bytes copied or what
            was waited for; ``phase`` the program's name for the part of the step).
    """

    name: str
    is_compute: bool
    time: float = 0.0
    busy_s: float = 0.0
    copy_s: float = 0.0
    waited_s: float = 0.0
    host_bound_s: float = 0.0
    log: list[tuple[float, float, str, Any, str]] = field(default_factory=list, repr=False)


class Timeline:
    """The clocks of one modeled run; see NOTE [Modeled clocks].

    Args:
        profile: the device's figures.
        record: keep a log of every kernel, copy and wait (for traces and plots).

    Attributes:
        host: the host clock.
        host_sync_s: time the host spent stalled in synchronisations and pageable copies.
        host_syncs: synchronising calls (``synchronize`` of the device, a stream or an
            event, pageable copies, reading a value from the device).
        engines: per copy engine, when its last copy completes.
        streams: every stream's clock, the compute stream first.
        host_log: ``(start, end, what)`` of each host stall.
        copied: bytes per direction (``"d2h"``, ``"h2d"``, ``"d2d"``).
        phase: the program's name for the part of the step it is in (``TimedReport.begin``).
        capture: the CUDA graph capture under way, which records the work of its
            streams instead (NOTE [Modeled CUDA graphs] in cuda_graphs.py), or None.
    """

    def __init__(self, profile: DeviceProfile, record: bool = True) -> None:
        self.profile = profile
        self.record = record
        self.host = 0.0
        self.host_sync_s = 0.0
        self.host_syncs = 0
        self.engines = dict.fromkeys(ENGINES, 0.0)
        self.streams: list[StreamClock] = []
        self.host_log: list[tuple[float, float, str]] = []
        self.copied = {"d2h": 0, "h2d": 0, "d2d": 0}
        self.phase = ""
        self.capture: Any = None
        self._issue = profile.host_issue_s
        self._launch = profile.launch_s

    def new_stream(self, name: str, is_compute: bool = False) -> StreamClock:
        clock = StreamClock(name, is_compute)
        self.streams.append(clock)
        return clock

    def _start(self, stream: StreamClock) -> float:
        """Issue one piece of work on ``stream``: the host pays for it; when it starts."""
        self.host += self._issue
        start = stream.time if stream.time >= self.host else self.host
        if start > stream.time and stream.is_compute:
            stream.host_bound_s += start - stream.time
        return start

    def kernel(self, stream: StreamClock, seconds: float, what: Any) -> float:
        """A kernel of ``seconds`` on ``stream``; returns its start."""
        if self.capture is not None and stream in self.capture.streams:
            self.capture.kernel(stream, seconds, what)
            return self.now(stream)
        start = self._start(stream)
        stream.time = start + seconds
        stream.busy_s += seconds
        if self.record:
            stream.log.append((start, stream.time, "kernel", what, self.phase))
        return start

    def copy(
        self, stream: StreamClock, direction: str, nbytes: int, pinned: bool, what: Any
    ) -> float:
        """A copy of ``nbytes`` on ``stream`` (``direction`` ``"d2h"``, ``"h2d"`` or
        ``"d2d"``); a pageable one holds the host until it completes.  Returns its start."""
        if self.capture is not None and stream in self.capture.streams:
            self.capture.copy(stream, direction, nbytes, what)
            return self.now(stream)
        profile = self.profile
        start = self._start(stream)
        if direction == "d2d":  # read and write device memory
            seconds = profile.kernel_seconds(0, 2 * nbytes)
        else:
            rate = (profile.d2h if direction == "d2h" else profile.h2d) if pinned else None
            seconds = nbytes / (rate or profile.pageable) + self._launch
            engine_free = self.engines[direction]
            if engine_free > start:
                if stream.is_compute:
                    stream.waited_s += engine_free - start
                start = engine_free
            self.engines[direction] = start + seconds
        stream.time = start + seconds
        stream.copy_s += seconds
        self.copied[direction] += nbytes
        if self.record:
            stream.log.append((start, stream.time, direction, what, self.phase))
        if not pinned and direction != "d2d":
            self.host_wait(stream.time, "pageable copy")
        return start

    def wait(self, stream: StreamClock, time: float, what: Any = "wait") -> None:
        """``stream`` waits for an event of another stream that completes at ``time``."""
        ready = stream.time if stream.time >= self.host else self.host
        if time > ready:
            if stream.is_compute:
                stream.waited_s += time - ready
            if self.record:
                stream.log.append((ready, time, "wait", what, self.phase))
        if time > stream.time:
            stream.time = time

    def host_wait(self, time: float, what: str) -> None:
        """The host stalls until ``time`` (a synchronisation)."""
        self.host_syncs += 1
        if time > self.host:
            self.host_sync_s += time - self.host
            if self.record:
                self.host_log.append((self.host, time, what))
            self.host = time

    @contextlib.contextmanager
    def graph_launch(self) -> Iterator[None]:
        """One graph launch: the host pays for one issue, and none for the work the
        block re-issues."""
        self.host += self._issue
        issue, self._issue = self._issue, 0.0
        try:
            yield
        finally:
            self._issue = issue

    def now(self, stream: StreamClock) -> float:
        """Where ``stream`` is when the host issues to it now: the time new work on it
        would start, an event recorded on it completes, memory freed on it is free."""
        return stream.time if stream.time >= self.host else self.host

    def end(self) -> float:
        """When everything issued so far has completed."""
        return max([self.host, *(s.time for s in self.streams)])
