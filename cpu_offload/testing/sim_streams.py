"""The strict simulator's streams, events and queued copies (NOTE [Strict stream
simulation] in simulator.py), and what it counts."""

from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef

#: the simulator these belong to (simulator.SimulatedBackend, which imports this module)
SimulatedBackend = Any

__all__ = [
    "QueuedCopy",
    "QueuedWait",
    "SimulatedEvent",
    "SimulatedStream",
    "StreamCounters",
    "describe",
    "storage_key",
]


@dataclass
class StreamCounters:
    """What the simulator saw.

    Attributes:
        copies_queued: copies issued on a side stream.
        copies_run: queued copies that ran.
        bytes_copied: bytes moved by copies that ran.
        event_waits: ``wait_event``/``wait_stream`` calls.
        synchronizations: ``synchronize`` calls.
        handoffs: tensors handed back to autograd after a reload.
        hazards: hazards detected.
        torn_copies: copies whose source compute wrote while they were queued (see
            NOTE [Torn copies]).
    """

    copies_queued: int = 0
    copies_run: int = 0
    bytes_copied: int = 0
    event_waits: int = 0
    synchronizations: int = 0
    handoffs: int = 0
    hazards: int = 0
    torn_copies: int = 0


def describe(tensor: torch.Tensor | None, label: str, shape: Any = None, dtype: Any = None) -> str:
    if tensor is not None:
        shape, dtype = tuple(tensor.shape), tensor.dtype
    where = f" of {label}" if label else ""
    return f"tensor{where} (shape {tuple(shape)}, dtype {dtype})"


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of a tensor's storage, or ``None`` for tensors without a plain one
    (wrapper subclasses, nested and sparse tensors, storages of fake or meta tensors)."""
    try:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        return storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _End:
    """One end of a queued copy, held as an accelerator holds a pointer: weakly.

    A plain tensor is held through a weak reference to its *storage*: the memory is
    what must stay valid, and a temporary view of it (a flattened copy argument) may
    go.  The storage's weak pointer also outlives the clearing of Python weak
    references in a garbage-collection cycle, as device memory outlives it on a GPU
    (the layer state's finalizer issues its wait before the tensors are freed).
    Other tensors (subclasses, storages of fake tensors) are held by weak reference.
    """

    __slots__ = ("tensor", "storage", "geometry", "version_of", "version", "key")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.key = storage_key(tensor)
        self.version = tensor._version  # views share their base's counter
        base = tensor._base
        plain_base = type(base) is torch.Tensor and base.layout is torch.strided
        self.version_of = weakref.ref(base if plain_base else tensor)
        self.tensor: weakref.ref[torch.Tensor] | None = None
        self.storage: StorageWeakRef | None = None
        if self.key is not None and type(tensor) is torch.Tensor:
            self.storage = StorageWeakRef(tensor.untyped_storage())
            self.geometry = (
                tensor.dtype,
                tensor.device,
                tensor.shape,
                tensor.stride(),
                tensor.storage_offset(),
            )
        else:
            self.tensor = weakref.ref(tensor)

    def get(self) -> torch.Tensor | None:
        if self.tensor is not None:
            return self.tensor()
        if self.storage is None or self.storage.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        dtype, device, shape, stride, offset = self.geometry
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)

    def modified(self) -> bool:
        holder = self.version_of()
        return holder is not None and holder._version != self.version


class QueuedCopy:
    """A queued copy between two weakly held ends."""

    def __init__(self, sim: SimulatedBackend, dst: torch.Tensor, src: torch.Tensor, label: str):
        self.sim = sim
        self.src, self.dst = _End(src), _End(dst)
        self.shape, self.dtype, self.label = tuple(src.shape), src.dtype, label
        self.done = False
        self.torn = False  # compute wrote the source while the copy was queued

    def describe(self) -> str:
        return describe(None, self.label, self.shape, self.dtype)

    def run(self) -> None:
        sim = self.sim
        sim.forget_pending(self)
        self.done = True
        with sim.suspended():
            src, dst = self.src.get(), self.dst.get()
        if sim.counters.hazards and (src is None or dst is None or self.src.modified()):
            # The program failed at its first hazard; this is its cleanup (a graph freed
            # with the traceback, whose finalizer waits for the copies still queued),
            # which must not raise again where nobody can catch it.
            sim.counters.hazards += 1
            return
        if src is None:
            sim.hazard(
                f"the source of a queued copy, {self.describe()}, was freed before the copy "
                "ran: its memory was released without waiting for the copy's event."
            )
        if dst is None:
            sim.hazard(
                f"the destination of a queued copy, {self.describe()}, was freed before the "
                "copy ran: a tensor was dropped while a copy into it was in flight."
            )
        # A source modified in place while queued: NOTE [Torn copies].
        torn = self.torn or self.src.modified() or self.src.key in sim.torn
        if torn:
            sim.counters.torn_copies += 1
            sim.torn.add(self.dst.key)
        else:
            sim.torn.discard(self.dst.key)
        src, dst = cast(torch.Tensor, src), cast(torch.Tensor, dst)  # sim.hazard raised
        with sim.suspended():
            dst.copy_(src)
        sim.counters.copies_run += 1
        sim.counters.bytes_copied += src.numel() * src.element_size()


class QueuedWait:
    """A side stream waiting for a position in another side stream."""

    def __init__(self, stream: SimulatedStream, position: int) -> None:
        self.stream, self.position = stream, position
        self.done = False

    def run(self) -> None:
        self.done = True
        self.stream.run_until(self.position)


class SimulatedStream:
    """A stream of the simulator: compute runs eagerly, side streams queue work."""

    _ids = itertools.count()

    def __init__(self, sim: SimulatedBackend, is_compute: bool) -> None:
        self.sim = sim
        self.is_compute = is_compute
        self.name = "compute" if is_compute else f"side stream {next(self._ids)}"
        self.queue: list[QueuedCopy | QueuedWait] = []
        self.executed = 0
        self.waited_compute_seq = 0  # compute work this stream has waited for

    def run_until(self, position: int) -> None:
        # A garbage collection inside a copy (any allocation) may run a layer's
        # finalizer, which waits on this stream: the nested wait would find the copy
        # in progress counted as executed and return before it ran.  A device runs its
        # queue apart from the host; so does the simulator, with the collector off.
        # Another thread's wait would find the same: it waits for the lock, as a wait
        # on a device blocks until the copies before it have finished (NOTE [Threads]).
        with self.sim.lock:
            collecting = gc.isenabled()
            gc.disable()
            try:
                while self.executed < min(position, len(self.queue)):
                    item = self.queue[self.executed]
                    self.executed += 1
                    item.run()
            finally:
                if collecting:
                    gc.enable()

    def wait_event(self, event: SimulatedEvent) -> None:
        self.sim.wait_event(self, event)

    def wait_stream(self, other: SimulatedStream) -> None:
        self.sim.wait_stream(self, other)

    def synchronize(self) -> None:
        self.sim.counters.synchronizations += 1
        self.run_until(len(self.queue))

    def __repr__(self) -> str:
        return f"SimulatedStream({self.name}, queued={len(self.queue) - self.executed})"


class SimulatedEvent:
    """A position in a stream's queue (or, on compute, a compute sequence number)."""

    def __init__(self, sim: SimulatedBackend) -> None:
        self.sim = sim
        self.stream: SimulatedStream | None = None
        self.position = 0
        self.compute_seq = 0

    def record(self, stream: SimulatedStream | None = None) -> None:
        stream = self.sim.compute if stream is None else stream
        self.stream = stream
        self.position = len(stream.queue)
        self.compute_seq = self.sim.compute_seq

    def synchronize(self) -> None:
        self.sim.counters.synchronizations += 1
        if self.stream is not None and self.stream.is_compute:
            self.sim.synced_seq = max(self.sim.synced_seq, self.compute_seq)
        if self.stream is not None:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        return self.stream is None or self.stream.executed >= self.position
