"""What the offloader asks of a device, and the host's answer.

:class:`DeviceBackend` is the interface every other module uses for streams, events,
copies, host buffers and memory statistics (the :class:`Stream`, :class:`Event` and
:class:`TimingEvent` protocols type what it hands out).  :class:`HostBackend` serves a
machine without an accelerator: "device" tensors are CPU tensors and copies are
synchronous, on the same schedule.  Accelerators are served by ``runtime.py``, the one
module that talks to their runtimes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "DeviceBackend",
    "Event",
    "HostBackend",
    "HostTimingEvent",
    "Stream",
    "TimingEvent",
    "host_memory_available",
    "is_dense",
]


class Event(Protocol):
    """What the offloader asks of an event (``torch.cuda.Event``, ``torch.npu.Event``, ...)."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...


class TimingEvent(Event, Protocol):
    """An event created with timing enabled."""

    def elapsed_time(self, end: Any) -> float: ...


@runtime_checkable
class Stream(Protocol):
    """What the offloader asks of a stream (``torch.cuda.Stream``, ``torch.npu.Stream``, ...)."""

    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...


class DeviceBackend:
    """Streams, events, copies and memory statistics of one device.

    Attributes:
        device: the device whose tensors are offloaded.
        pin_memory: whether host buffers are page-locked.
        one_stream: whether the current stream is always the same (its key None):
            nothing asks which it is per saved tensor.
        one_memory: whether device tensors are host tensors and copies run at once
            (the host backend): a reload clones each host copy, one call per tensor.
    """

    device: torch.device
    pin_memory: bool = False
    one_stream = False
    one_memory = False

    @property
    def device_type(self) -> str:
        return self.device.type

    def new_stream(self) -> Stream:
        raise NotImplementedError

    def current_stream(self) -> Stream:
        raise NotImplementedError

    def new_event(self) -> Event:
        raise NotImplementedError

    def record_event(self, stream: Stream | None = None) -> Event:
        """Record a new event on ``stream`` (default: the current stream)."""
        event = self.new_event()
        event.record(self.current_stream() if stream is None else stream)
        return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        stream.wait_stream(other)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, label: str = "") -> None:
        """Copy ``src`` into ``dst``, ordered on ``stream``, without blocking the host."""
        raise NotImplementedError

    def empty_host(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer with the shape, strides and dtype of ``like`` (pinned if supported)."""
        return torch.empty_strided(
            like.shape, like.stride(), dtype=like.dtype, device="cpu", pin_memory=self.pin_memory
        )

    def copy_many(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Stream, label: str = ""
    ) -> None:
        """:meth:`copy` for each pair, in order."""
        for dst, src in zip(dsts, srcs):
            self.copy(dst, src, stream, label)

    def current_stream_key(self) -> object:
        """Something equal for equal current streams, cheaper to get than the stream."""
        return self.current_stream()

    def empty_host_bytes(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of host memory (pinned if supported), as a uint8 tensor."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)

    def host_round_threshold(self) -> int | None:
        """Bytes above which a host request is held at its size (aligned to 512); at or
        below it, at the next power of two; None: every request is rounded.  0 where
        host memory is not pinned (NOTE [Pinned sizes as torch holds them])."""
        return 0

    def empty_host_cache(self) -> None:
        """Hand the pinned blocks freed by the host pool back to the OS."""

    def empty_device(self, like: torch.Tensor) -> torch.Tensor:
        """A device tensor with the shape, strides and dtype of ``like``, on the current stream."""
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=self.device)

    def empty_device_many(
        self,
        layouts: list[tuple[torch.Size, tuple[int, ...], torch.dtype]],
        hosts: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Device tensors of the ``(shape, stride, dtype)`` of ``layouts``, on the current
        stream (one layer's reload); ``hosts``: the host copies, dense, of those layouts."""
        device = self.device
        return [
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype in layouts
        ]

    def timing_event(self) -> TimingEvent:
        """An event that can measure elapsed time (``record``, ``elapsed_time``)."""
        return HostTimingEvent()

    def is_capturing(self) -> bool:
        """Whether work on the current stream is being captured into a graph (a CUDA
        graph) instead of running."""
        return False

    @contextlib.contextmanager
    def count_host_syncs(self) -> Iterator[list[int] | None]:
        """Count host synchronisations inside the block (``None``: not measurable)."""
        yield None

    #: whether :meth:`before_handoff` must be called (a testing backend's check)
    checks_handoff = False

    def before_handoff(self, tensor: torch.Tensor, label: str = "") -> None:
        """Called, where :attr:`checks_handoff`, when a reloaded tensor is handed back to
        autograd (a testing hook)."""

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor``'s memory, allocated on another stream, is used on ``stream``: the
        allocator reuses it only after ``stream``'s work issued before its free."""

    def synchronize(self) -> None:
        raise NotImplementedError

    def memory_allocated(self) -> int | None:
        """Bytes allocated on the device, or ``None`` where the device does not report it."""
        return None

    def max_memory_allocated(self) -> int | None:
        return None

    def reset_peak_memory_stats(self) -> None:
        return None

    def memory_available(self) -> int | None:
        """Bytes that may still be allocated on the device, or ``None`` where unknown."""
        return None

    def memory_reserved(self) -> int | None:
        """Bytes the runtime's caching allocator holds (in use or cached), or ``None``."""
        return None


class _HostStream:
    """Stream of the host backend: work runs at once, so waits are no-ops."""

    def wait_event(self, event: Event) -> None:
        return None

    def wait_stream(self, stream: Stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _HostEvent:
    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class HostTimingEvent:
    """Wall-clock event: on the host, work is done when it is issued."""

    def __init__(self) -> None:
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end``."""
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time: both events must be recorded first.")
        return (end.time - self.time) * 1e3


class HostBackend(DeviceBackend):
    """No accelerator: "device" tensors are CPU tensors and copies are synchronous.

    The schedule is the same as on an accelerator, and offloaded tensors still go
    into separate host buffers, so every code path runs on a CPU-only machine.
    """

    one_stream = True
    one_memory = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._stream = _HostStream()

    def new_stream(self) -> Stream:
        return _HostStream()

    def current_stream(self) -> Stream:
        return self._stream

    def new_event(self) -> Event:
        return _HostEvent()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, label: str = "") -> None:
        dst.copy_(src)

    def copy_many(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Stream, label: str = ""
    ) -> None:
        torch._foreach_copy_(dsts, srcs)

    def empty_device_many(
        self,
        layouts: list[tuple[torch.Size, tuple[int, ...], torch.dtype]],
        hosts: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        # Host and "device" are one: ``empty_like`` of a dense tensor keeps its strides
        # exactly and costs a quarter less than ``empty_strided`` with the layout given.
        return [torch.empty_like(host) for host in hosts]

    def current_stream_key(self) -> object:
        return None  # one stream

    def synchronize(self) -> None:
        return None

    def memory_available(self) -> int | None:
        """The host's available memory: ``MemAvailable`` of ``/proc/meminfo`` (Linux), or
        its free pages where the system says, else ``None``."""
        return host_memory_available()


def host_memory_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory available to a new allocation, or ``None`` where unknown."""
    try:
        with open(meminfo) as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether the elements of ``tensor`` fill a block of memory exactly once.

    Contiguous tensors and permutations of them (a transposed SDPA output, say)
    are dense; such a tensor is copied with its own strides, exactly.
    """
    if tensor.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(tensor.shape, tensor.stride()) if s != 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True
