"""A CPU backend with accelerator stream semantics that makes ordering bugs loud.

NOTE [Strict stream simulation]
    Compute (the current stream) runs eagerly, as Python does.  A copy issued on
    any other stream is queued and its destination is poisoned until it runs; it
    runs as late as the program allows: when the compute stream waits for an
    event after it, when someone synchronizes, or at the end of the block.  A
    ``TorchDispatchMode`` watches every compute op and stamps the storages it
    writes with a sequence number, so the simulator knows whether a side stream
    waited for the compute work that produced what it copies.

    Hazards (raised at once as :class:`StreamHazardError`):
      * a side-stream copy reads a tensor written by compute work the stream never
        waited for (a missing ready event);
      * a queued copy's source was freed, or its destination freed, before the copy
        ran;
      * compute reads a tensor a queued copy is still writing, or writes one a
        queued copy still writes (this covers handing a reloaded tensor back to
        autograd too early);
      * a copy is issued into a buffer that a queued copy still reads or writes;
      * a tensor handed back to autograd holds torn data (below).

NOTE [Torn copies]
    Compute may write a tensor that a queued copy still reads: a saved tensor modified
    in place after its offload started.  On a device the copy then reads a mix of old
    and new values.  That is no hazard by itself: autograd's version check makes the
    unpack of such a tensor raise, so its copy is never used.  The simulator marks the
    copy's destination torn (``counters.torn_copies``) and every copy made from torn
    data torn as well; a torn tensor handed back to autograd is the hazard, and a clean
    copy into a buffer makes it whole again.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..device.backend import DeviceBackend, Event, Stream
from ..device.runtime import override_host_backend
from ..errors import CpuOffloadError
from ..hooks.tensor_group import is_dense

__all__ = [
    "ComputeWatch",
    "SimulatedBackend",
    "StreamCounters",
    "StreamHazardError",
    "strict_streams",
]

_POISON_BYTE = 0xA5


class StreamHazardError(CpuOffloadError):
    """A stream-ordering mistake that would corrupt data on a real accelerator."""


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


def _describe(tensor: torch.Tensor | None, label: str, shape: Any = None, dtype: Any = None) -> str:
    if tensor is not None:
        shape, dtype = tuple(tensor.shape), tensor.dtype
    where = f" of {label}" if label else ""
    return f"tensor{where} (shape {tuple(shape)}, dtype {dtype})"


def _storage_key(tensor: torch.Tensor) -> int | None:
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
        self.key = _storage_key(tensor)
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


class _Copy:
    """A queued copy between two weakly held ends."""

    def __init__(self, sim: SimulatedBackend, dst: torch.Tensor, src: torch.Tensor, label: str):
        self.sim = sim
        self.src, self.dst = _End(src), _End(dst)
        self.shape, self.dtype, self.label = tuple(src.shape), src.dtype, label
        self.done = False
        self.torn = False  # compute wrote the source while the copy was queued

    def describe(self) -> str:
        return _describe(None, self.label, self.shape, self.dtype)

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
        with sim.suspended():
            dst.copy_(src)
        sim.counters.copies_run += 1
        sim.counters.bytes_copied += src.numel() * src.element_size()


class _Wait:
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
        self.queue: list[_Copy | _Wait] = []
        self.executed = 0
        self.waited_compute_seq = 0  # compute work this stream has waited for

    def run_until(self, position: int) -> None:
        # A garbage collection inside a copy (any allocation) may run a layer's
        # finalizer, which waits on this stream: the nested wait would find the copy
        # in progress counted as executed and return before it ran.  A device runs its
        # queue apart from the host; so does the simulator, with the collector off.
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
        if self.stream is not None:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        return self.stream is None or self.stream.executed >= self.position


class ComputeWatch(TorchDispatchMode):
    """Stamps writes of compute ops and checks them against queued copies."""

    def __init__(self, sim: SimulatedBackend) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sim = self.sim
        if sim.suspend_depth or getattr(func, "is_view", False):
            return func(*args, **kwargs)  # views touch metadata, not data
        if sim.current is not sim.compute:
            return sim.run_on_side_stream(func, args, kwargs)
        flat_args, _ = tree_flatten((args, kwargs))
        written_args = _mutated_args(func, args, kwargs)
        for tensor in flat_args:
            if isinstance(tensor, torch.Tensor):
                sim.check_compute_access(tensor, write=any(tensor is w for w in written_args))
        out = func(*args, **kwargs)
        sim.compute_seq += 1
        flat_out, _ = tree_flatten(out)
        for tensor in itertools.chain(flat_out, written_args):
            if isinstance(tensor, torch.Tensor):
                key = _storage_key(tensor)
                if key is not None:
                    sim.last_write[key] = sim.compute_seq
        if sim.torn:  # a new output at a torn address is new memory (NOTE [Torn copies])
            for tensor in flat_out:
                if isinstance(tensor, torch.Tensor) and not any(tensor is w for w in written_args):
                    sim.torn.discard(_storage_key(tensor))
        return out


def _mutated_args(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    mutated = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            mutated.append(value)
    return mutated


class SimulatedBackend(DeviceBackend):
    """The host device with simulated streams; see NOTE [Strict stream simulation]."""

    checks_handoff = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.counters = StreamCounters()
        self.compute = SimulatedStream(self, is_compute=True)
        self.streams: list[SimulatedStream] = []
        self.compute_seq = 0
        self.last_write: dict[int, int] = {}
        self.pending_reads: Counter[int] = Counter()
        self.pending_writes: Counter[int] = Counter()
        self.torn: set[int | None] = set()  # storages holding torn data (NOTE [Torn copies])
        self.suspend_depth = 0
        #: the stream ops run on; only a simulated runtime's ``stream(s)`` changes it
        self.current: SimulatedStream = self.compute
        #: whether a side-stream copy between non-contiguous tensors is a hazard
        #: (torch_npu synchronises such copies)
        self.contiguous_copies_only = False

    # ------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the simulator's own copies: unwatched and outside autograd."""
        self.suspend_depth += 1
        try:
            with torch.no_grad():
                yield
        finally:
            self.suspend_depth -= 1

    def hazard(self, message: str) -> NoReturn:
        self.counters.hazards += 1
        raise StreamHazardError(f"strict_streams: {message}")

    def forget_pending(self, copy: _Copy) -> None:
        if copy.src.key is not None:
            self.pending_reads[copy.src.key] -= 1
        if copy.dst.key is not None:
            self.pending_writes[copy.dst.key] -= 1

    def check_compute_access(self, tensor: torch.Tensor, write: bool) -> None:
        key = _storage_key(tensor)
        if key is None:
            return
        if self.pending_writes[key] > 0:
            self.hazard(
                f"compute {'wrote' if write else 'read'} {_describe(tensor, '')} while a "
                "queued copy into it had not run: a wait for the copy's event is missing."
            )
        if write and self.pending_reads[key] > 0:
            for stream in self.streams:  # NOTE [Torn copies]
                for item in stream.queue[stream.executed :]:
                    if isinstance(item, _Copy) and item.src.key == key:
                        item.torn = True

    def run_on_side_stream(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op issued while a side stream is current: copies are queued there."""
        if func is not torch.ops.aten.copy_.default:
            raise StreamHazardError(
                f"strict_streams: {func} was issued on {self.current.name}; the simulator "
                "runs only copies on side streams (run other work on the compute stream)."
            )
        dst, src = args[0], args[1]
        self.copy(dst, src, self.current)
        return dst

    # ------------------------------------------------------ DeviceBackend

    def new_stream(self) -> SimulatedStream:
        stream = SimulatedStream(self, is_compute=False)
        self.streams.append(stream)
        return stream

    def current_stream(self) -> SimulatedStream:
        return self.compute

    def new_event(self) -> SimulatedEvent:
        return SimulatedEvent(self)

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream, event = cast(SimulatedStream, stream), cast(SimulatedEvent, event)
        self.counters.event_waits += 1
        source = event.stream
        if source is None or source is stream:
            return
        if source.is_compute:
            stream.waited_compute_seq = max(stream.waited_compute_seq, event.compute_seq)
        elif stream.is_compute:
            source.run_until(event.position)
        else:
            stream.queue.append(_Wait(source, event.position))

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        event = self.new_event()
        event.record(cast(SimulatedStream, other))
        self.wait_event(stream, event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, label: str = "") -> None:
        if stream.is_compute:
            self.check_compute_access(src, write=False)
            self.check_compute_access(dst, write=True)
            with self.suspended():
                dst.copy_(src)
            return
        if self.contiguous_copies_only and not (src.is_contiguous() and dst.is_contiguous()):
            self.hazard(
                f"a copy of {_describe(src, label)} with strides {src.stride()} into strides "
                f"{dst.stride()} was issued on {stream.name}: torch_npu copies between "
                "non-contiguous tensors through pageable memory and synchronises the host."
            )
        item = _Copy(self, dst, src, label)
        src_key, dst_key = item.src.key, item.dst.key
        if src_key is not None and self.last_write.get(src_key, 0) > stream.waited_compute_seq:
            self.hazard(
                f"a copy of {_describe(src, label)} was issued on {stream.name} before that "
                "stream waited for the compute work that wrote it (a missing wait on the "
                "tensor's ready event)."
            )
        if dst_key is not None and (self.pending_reads[dst_key] or self.pending_writes[dst_key]):
            self.hazard(
                f"a copy into {_describe(dst, label)} was issued while an earlier queued "
                "copy still reads or writes that buffer (a buffer reused too early)."
            )
        if src_key is not None:
            self.pending_reads[src_key] += 1
        if dst_key is not None:
            self.pending_writes[dst_key] += 1
        with self.suspended():
            if dst.is_floating_point():
                dst.fill_(float("nan"))
            elif is_dense(dst):
                # Its elements as one flat run of memory (an (N, 1) index tensor with
                # strides (1, N) is contiguous but cannot be viewed as bytes itself).
                flat = dst.as_strided((dst.numel(),), (1,), dst.storage_offset())
                flat.view(torch.uint8).fill_(_POISON_BYTE)
        stream.queue.append(item)
        self.counters.copies_queued += 1

    def before_handoff(self, tensor: torch.Tensor, label: str = "") -> None:
        self.counters.handoffs += 1
        key = _storage_key(tensor)
        if key is not None and self.pending_writes[key] > 0:
            self.hazard(
                f"{_describe(tensor, label)} was handed back to autograd while the copy "
                "that reloads it was still queued (a missing wait on its reload event)."
            )
        if key in self.torn:
            self.hazard(
                f"{_describe(tensor, label)} was handed back to autograd holding torn data: "
                "a copy it came from read its source while compute was writing it (the "
                "tensor was modified in place after its offload started, and the unpack "
                "did not refuse it)."
            )

    def synchronize(self) -> None:
        self.counters.synchronizations += 1
        for stream in self.streams:
            stream.run_until(len(stream.queue))

    def queued_copies(self) -> int:
        """Copies issued but not run yet, over all streams."""
        return sum(
            1
            for stream in self.streams
            for item in stream.queue[stream.executed :]
            if isinstance(item, _Copy)
        )


@contextlib.contextmanager
def strict_streams() -> Iterator[SimulatedBackend]:
    """Run the CPU path of cpu_offload with simulated accelerator streams.

    Offload contexts created inside the block use a :class:`SimulatedBackend`;
    every missing wait raises :class:`StreamHazardError`. Queued copies left at the
    end of the block are run then (and may raise).

    Example:
        >>> import torch
        >>> from cpu_offload import get_cpu_offload_context
        >>> from cpu_offload.testing import strict_streams
        >>> with strict_streams() as sim:
        ...     ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
        ...     x = torch.randn(16, 16, requires_grad=True)
        ...     for _ in range(2):
        ...         with ctx:
        ...             x = x.sin()
        ...         x = sync_fn(x)
        ...     x.sum().backward()
        >>> sim.counters.copies_run
        2
    """
    sim = SimulatedBackend()
    with override_host_backend(lambda: sim), ComputeWatch(sim):
        yield sim
        sim.synchronize()
