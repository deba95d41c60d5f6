"""CUDA graphs on the modeled accelerator: capture records what the streams are given,
replay re-issues it on the clocks.

NOTE [Modeled CUDA graphs]
    ``capture_begin`` on a side stream starts a :class:`Capture`.  While it lasts, the
    work issued on a *capturing* stream (the capture stream, and every stream that waited
    for an event recorded on a capturing stream: the fork) is recorded, not run: each
    kernel with its modeled time, each copy with its bytes and direction, each event
    record and wait; no clock moves, the host's included.  A device allocation from a
    capturing stream comes from the graph's private pool (:class:`GraphPool`), which
    keeps the most it held at once (its reserve) from then until every graph using it is
    reset: device memory counts the reserve, not the live tensors in it (torch's
    ``memory_allocated`` counts only those; the reserve is what no other tensor can
    have).  ``replay`` is one ``cudaGraphLaunch``: one ``host_issue_s`` of host time,
    then the record is re-issued on the clocks with no host cost per node and no
    Python: the capture stream's work on the stream current at replay, each forked
    stream's on a branch clock of its own (as the graph's parallel branches run), copies
    on the copy engines at the pinned rates, waits between branches as captured.  Bytes
    moved grow per replay exactly as the captured copies; nothing is allocated.

    Capture refuses what CUDA and PyTorch refuse, raising :class:`CaptureError` (a
    ``RuntimeError``) whose ``kind`` is the CUDA error's name (``cudaErrorStream...``)
    or PyTorch's check:

    - a host synchronisation (``.item()``, ``torch.cuda.synchronize``, a stream's or an
      event's ``synchronize`` or ``query``, a pageable copy on a stream that is not
      captured): ``cudaErrorStreamCaptureUnsupported``; it invalidates the capture, so
      ``capture_end`` then raises ``cudaErrorStreamCaptureInvalidated``, as does any
      further work on a capturing stream.  In ``"relaxed"`` mode CUDA allows those that
      wait for nothing captured (an event or a stream outside the capture); a device
      synchronisation and ``.item()`` on a capturing stream are refused in every mode.
      ``query`` or ``synchronize`` of an event recorded in the capture is
      ``cudaErrorCapturedEvent`` (an event last recorded in a capturing stream); so is,
      in the model, any use of such an event outside its capture, a wait from eager
      code or from another capture included (CUDA refuses those as well: pytorch#192000;
      the model gives them this kind); its ``elapsed_time`` is cudaErrorInvalidValue;
    - a copy between pageable host memory and the device on a capturing stream: the
      ``RuntimeError`` of PyTorch's check (pytorch#172156, since 2.11; the copy is not
      issued and the capture stays valid).  Pinned copies, and pinned allocation
      (pytorch#167507), are allowed;
    - a capturing stream waiting for an event recorded outside the capture:
      ``cudaErrorStreamCaptureIsolation`` (only in-stream order may cross the capture's
      boundary), unless the event was made with ``external=True`` (an external wait
      node: at replay it waits for the event's latest record);
    - work issued on the default stream while another stream captures:
      ``cudaErrorStreamCaptureImplicit`` (the default stream is CUDA's legacy stream,
      which would synchronise with the capturing one).  A side stream that did not join
      the capture runs its work eagerly, outside the graph: CUDA and PyTorch accept it,
      and it is silently wrong when that work reads or writes memory of the capture.
      The model refuses exactly that (kind ``"uncaptured work on captured memory"``):
      a kernel or copy on a stream that did not join, touching a storage the capture
      allocated or wrote;
    - a forked stream with captured work that the capture stream did not wait for at
      ``capture_end``: ``cudaErrorStreamCaptureUnjoined``;
    - a device allocation outside the graph's pool during a global (or thread-local)
      capture, from a stream that is not captured: ``cudaErrorStreamCaptureUnsupported``
      (the allocator's ``cudaMalloc`` is a call CUDA prohibits then).  The model refuses
      every such allocation; PyTorch's allocator fails only when its cache has no block
      to give, which a program cannot know in advance.

    Also as PyTorch: capture on the default stream is refused, one capture at a time,
    ``capture_end`` on another stream than the capture's is
    ``cudaErrorStreamCaptureUnmatched``.  Simplified: a kernel's launch latency is the
    eager one at replay; a forked stream that joined but issued no work needs no join;
    a graph replayed inside another capture is not modeled.  The checks of NOTE
    [Allocator reuse across streams] see no use by the capture (it runs nothing) and
    each replay as a use, by the launch stream, of every block the captured work
    touched (the graph's branches are joined to it).
    In the data mode a replay also computes (NOTE [Data-mode replay] in
    cuda_graph_api.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..device.kernel_costs import storage_id
from .clocks import StreamClock
from .timed_streams import TimedEvent, TimedStream

__all__ = ["Capture", "CaptureError", "GraphPool"]

UNSUPPORTED = "cudaErrorStreamCaptureUnsupported"
INVALIDATED = "cudaErrorStreamCaptureInvalidated"
ISOLATION = "cudaErrorStreamCaptureIsolation"
IMPLICIT = "cudaErrorStreamCaptureImplicit"
UNJOINED = "cudaErrorStreamCaptureUnjoined"
UNMATCHED = "cudaErrorStreamCaptureUnmatched"
CAPTURED_EVENT = "cudaErrorCapturedEvent"
INVALID_VALUE = "cudaErrorInvalidValue"
UNPINNED = "pytorch#172156 unpinned copy during capture"
UNCAPTURED = "uncaptured work on captured memory"
FREED = "memory freed under a copy in flight"
MODES = ("global", "thread_local", "relaxed")


class CaptureError(RuntimeError):
    """What CUDA (or PyTorch) refuses during a graph capture; :attr:`kind` names it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"modeled CUDA graph capture ({kind}): {message}")
        self.kind = kind


class GraphPool:
    """A graph's private memory pool: its reserve is the most it held at once.

    Args:
        handle: its id, as ``graph_pool_handle()`` and ``CUDAGraph.pool()`` return it.
        change: how device memory hears of the reserve growing or going.
    """

    def __init__(self, handle: tuple[int, int], change: Callable[[int, float], None]) -> None:
        self.handle = handle
        self.change = change
        self.live = 0  # bytes of live tensors in it
        self.reserve = 0
        self.users = 0  # graphs capturing into it or holding it
        self.released = False

    def take(self, nbytes: int, time: float) -> None:
        self.live += nbytes
        if self.live > self.reserve:
            self.change(self.live - self.reserve, time)
            self.reserve = self.live

    def give(self, nbytes: int, time: float) -> None:
        self.live -= nbytes
        if self.released and self.live == 0:
            self._free(time)

    def release(self, time: float) -> None:
        """A graph using it was reset (or failed to capture)."""
        self.users -= 1
        if self.users == 0:
            self.released = True
            if self.live == 0:
                self._free(time)

    def _free(self, time: float) -> None:
        if self.reserve:
            self.change(-self.reserve, time)
            self.reserve = 0


class Capture:
    """A capture under way: its streams, its record, and CUDA's rules (NOTE [Modeled CUDA
    graphs]).  Node tuples: ``("kernel", stream, seconds, what)``, ``("copy", stream,
    direction, nbytes, what)``, ``("record", stream, key)``, ``("wait", stream, key)``,
    ``("external wait"|"external record", stream, event)``; ``stream`` indexes
    :attr:`clocks` (0: the capture stream)."""

    def __init__(
        self,
        origin: TimedStream,
        compute: StreamClock,
        mode: str,
        pool: GraphPool,
        pool_of: Callable[[torch.Tensor], bool],
    ) -> None:
        self.origin = origin
        self.pool_of = pool_of  # whether a tensor's memory is a graph pool's
        self.compute = compute  # the default (legacy) stream
        self.mode = mode
        self.pool = pool
        self.clocks: list[StreamClock] = [origin.clock]
        self.streams: dict[StreamClock, int] = {origin.clock: 0}
        self.nodes: list[tuple[Any, ...]] = []
        self.work = [0]  # kernels and copies per stream
        self.known: list[dict[int, int]] = [{}]  # per stream: the work it is ordered after
        self.stamps: list[dict[int, int]] = []  # per captured record
        self.written: set[int] = set()  # storages captured work wrote
        self.touched: set[int] = set()  # storages captured work reads or writes
        self.invalid: CaptureError | None = None

    def _live(self) -> None:
        if self.invalid is not None:
            raise CaptureError(
                INVALIDATED,
                f"work issued on a capturing stream after the capture was invalidated by "
                f"{self.invalid.kind}; end it (capture_end raises) and capture again.",
            )

    def refuse(self, kind: str, message: str, invalidates: bool = True) -> CaptureError:
        error = CaptureError(kind, message)
        if invalidates and self.invalid is None:
            self.invalid = error
        return error

    # -- work on the streams (Timeline.kernel / Timeline.copy hand it here)
    def kernel(self, clock: StreamClock, seconds: float, what: Any) -> None:
        self._live()
        index = self.streams[clock]
        self.nodes.append(("kernel", index, seconds, what))
        self.work[index] += 1

    def copy(self, clock: StreamClock, direction: str, nbytes: int, what: Any) -> None:
        self._live()
        index = self.streams[clock]
        self.nodes.append(("copy", index, direction, nbytes, what))
        self.work[index] += 1

    def issue(self, clock: StreamClock, what: Any, tensors: Iterable[Any], writes: Any) -> None:
        """A kernel or copy ``what`` is about to be issued on ``clock``'s stream: captured
        work notes what it writes; other streams' work must not touch the capture's."""
        if clock in self.streams:
            self.written.update(k for k in map(storage_id, writes) if k is not None)
            self.touched.update(k for k in map(storage_id, tensors) if k is not None)
            return
        if clock is self.compute:
            raise self.refuse(
                IMPLICIT,
                f"{what} was issued on the default stream while {self.origin.clock.name} "
                "captures; the default (legacy) stream synchronises with every stream. "
                "Issue it on the capturing stream (inside torch.cuda.graph's block), or "
                "on a side stream that waited for it (side.wait_stream(capture stream)).",
            )
        for tensor in tensors:
            block = self.pool_of(tensor)
            if block or storage_id(tensor) in self.written:
                raise self.refuse(
                    UNCAPTURED,
                    f"{what} on {clock.name}, a stream that did not join the capture, "
                    f"touches a tensor (shape {tuple(tensor.shape)}) the capture "
                    f"{'allocated' if block else 'writes'}: CUDA runs it now, outside the "
                    "graph, and replays will not. Make the stream join the capture first "
                    f"({clock.name}.wait_stream(capture stream)) and the capture stream "
                    "wait for it before capture_end.",
                    invalidates=False,
                )

    def transfer(self, clock: StreamClock, direction: str, pinned: bool) -> None:
        """A copy between host and device memory (``direction``) on ``clock``'s stream."""
        if pinned or direction == "d2d":
            return
        if clock in self.streams:
            raise self.refuse(
                UNPINNED,
                f"a {direction} copy with pageable host memory on capturing stream "
                f"{clock.name}: PyTorch refuses copies between CPU memory that is not "
                "pinned and CUDA during capture. Copy from or into pinned memory "
                "(pin_memory=True), allocated before the capture or inside it.",
                invalidates=False,
            )
        self.sync(f"a {direction} copy with pageable memory on {clock.name}", clock)

    # -- synchronisation and events
    def sync(self, what: str, clock: StreamClock | None) -> None:
        """The host would wait for ``clock``'s stream (None: the device, or a value)."""
        if self.mode == "relaxed" and clock is not None and clock not in self.streams:
            return
        raise self.refuse(
            UNSUPPORTED,
            f"the program called {what} while {self.origin.clock.name} captures "
            f"(mode {self.mode!r}): the host cannot wait during capture; a replay runs "
            "no Python. Read values and synchronise before capture_begin or after "
            "capture_end.",
        )

    def event_sync(self, what: str, event: TimedEvent) -> None:
        if event.captured is not None and event.captured[0] is not self:
            raise event.captured[0].used_after(what)
        if event.captured is not None:
            raise self.refuse(
                CAPTURED_EVENT,
                f"{what} of an event recorded in the capture: it marks a point of the "
                "graph, not of work the host can wait for.",
                invalidates=False,
            )
        stream = event.stream
        self.sync(what, None if stream is None else stream.clock)

    def used_after(self, what: str) -> CaptureError:
        """``what`` (a wait, ``synchronize``, ``query``) of an event last recorded in this
        capture, from outside it: the event is an edge of the graph, not a point of work."""
        return CaptureError(CAPTURED_EVENT, self.outside(what))

    def untimed(self) -> CaptureError:
        """``elapsed_time`` of an event last recorded in this capture: CUDA answers
        cudaErrorInvalidValue (a captured record is a dependency of the graph, not a
        timestamp; NVIDIA/warp#556, #983)."""
        return CaptureError(
            INVALID_VALUE,
            f"event.elapsed_time() of an event last recorded during the capture on "
            f"{self.origin.clock.name}: a captured record marks no time. Time a graph "
            "from outside its replay, or with events made with Event(external=True).",
        )

    def outside(self, what: str) -> str:
        return (
            f"{what} of an event last recorded during the capture on "
            f"{self.origin.clock.name}, from outside that capture (eager code or another "
            "capture): no work outside the graph marks it (pytorch#192000). Record the "
            "event again outside the capture, or make it with Event(external=True)."
        )

    def record(self, event: TimedEvent, clock: StreamClock) -> bool:
        """``event.record`` on ``clock``'s stream; False when the stream is not captured."""
        index = self.streams.get(clock)
        if index is None:
            return False
        if event.external:
            self.nodes.append(("external record", index, event))
            return True
        stamp = {**self.known[index], index: self.work[index]}
        event.captured = (self, len(self.stamps))
        self.nodes.append(("record", index, len(self.stamps)))
        self.stamps.append(stamp)
        return True

    def wait(self, stream: TimedStream, event: TimedEvent) -> bool:
        """``stream.wait_event(event)``; False when the capture has no part in it."""
        clock = stream.clock
        index = self.streams.get(clock)
        mine = event.captured is not None and event.captured[0] is self
        if event.captured is not None and not mine:  # another capture's: this one fails
            message = event.captured[0].outside(f"a wait by {clock.name}")
            raise self.refuse(CAPTURED_EVENT, message)
        if index is None and not mine:
            return False
        if index is None:  # a fork: the stream joins the capture
            index = self.streams[clock] = len(self.clocks)
            self.clocks.append(clock)
            self.work.append(0)
            self.known.append({})
        if mine:
            assert event.captured is not None
            key = event.captured[1]
            for other, seq in self.stamps[key].items():
                if self.known[index].get(other, 0) < seq:
                    self.known[index][other] = seq
            self.nodes.append(("wait", index, key))
        elif event.external:
            self.nodes.append(("external wait", index, event))
        elif event.stream is not None:
            raise self.refuse(
                ISOLATION,
                f"capturing stream {clock.name} waits for an event recorded outside the "
                f"capture (on {event.stream.clock.name}): a dependency across the "
                "capture's boundary. Wait before capture_begin, or record the event "
                "inside the capture, or make it with Event(external=True).",
            )
        return True

    def allocation(self, clock: StreamClock, what: str) -> GraphPool | None:
        """A device allocation from ``clock``'s stream: the pool it comes from."""
        if clock in self.streams:
            return self.pool
        if self.mode == "relaxed":
            return None
        raise self.refuse(
            UNSUPPORTED,
            f"{what} allocated on {clock.name}, which is not capturing, while "
            f"{self.origin.clock.name} captures (mode {self.mode!r}): outside the graph's "
            "pool the caching allocator may call cudaMalloc, which CUDA prohibits then. "
            "Allocate it before the capture, or on a stream that joined it.",
        )

    def unjoined(self) -> list[str]:
        """The forked streams whose work the capture stream did not wait for."""
        known = self.known[0]
        return [
            self.clocks[index].name
            for index in range(1, len(self.clocks))
            if self.work[index] > known.get(index, 0)
        ]
