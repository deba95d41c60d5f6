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

NOTE [Threads]
    Several threads may run offloaded forwards and backwards on one simulator, as on
    one device: the queues are shared, and a wait returns only when the copies before
    it have run, whichever thread runs them (a lock held while copies are queued or
    run), and each thread has its current stream.  The compute watch is a dispatch
    mode, entered by ``strict_streams()`` in its own thread: compute in other threads
    is not checked against queued copies.

NOTE [Torn copies]
    Compute may write a tensor that a queued copy still reads: a saved tensor modified
    in place after its offload started.  On a device the copy then reads a mix of old
    and new values.  That is no hazard by itself: autograd's version check makes the
    unpack of such a tensor raise, so its copy is never used.  The simulator marks the
    copy's destination torn (``counters.torn_copies``) and every copy made from torn
    data torn as well; a torn tensor handed back to autograd is the hazard, and a clean
    copy into a buffer makes it whole again.

NOTE [Compiled code on the simulator]
    The compute watch (and the modeled accelerator's ``OpTiming``) say
    ``ignore_compile_internals()``: dynamo compiles under them, with the mode off
    while it and the compilers trace, and the compiled code runs with the mode on.
    An ``aot_eager`` graph calls its operators one by one at run time, so the
    simulator sees each as it sees eager code; an inductor kernel is one call the
    mode never sees (its reads and writes are not checked, nor timed).  Without
    this, dynamo would compile no frame under the mode, and a ``fullgraph=True``
    block would raise "found no compiled frames".
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import Counter
from collections.abc import Hashable, Iterator
from typing import Any, NoReturn, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..device.backend import DeviceBackend, Event, Stream, is_dense
from ..device.runtime import override_host_backend
from .allocator_pools import FreedBlock, StreamHazardError, StreamPools, Use, round_size
from .sim_streams import (
    QueuedCopy,
    QueuedWait,
    SimulatedEvent,
    SimulatedStream,
    StreamCounters,
    describe,
    storage_key,
)

__all__ = [
    "ComputeWatch",
    "SimulatedBackend",
    "SimulatedEvent",
    "SimulatedStream",
    "StreamCounters",
    "StreamHazardError",
    "strict_streams",
]

_POISON_BYTE = 0xA5
aten = torch.ops.aten
#: allocations a side stream may issue (NOTE [Allocator reuse across streams])
_ALLOCATIONS = (
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
)


class CompiledCodeMode(TorchDispatchMode):
    """A dispatch mode that compiled code runs under: the compute watch and the modeled
    accelerator's ``OpTiming``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles under this mode (it is off while dynamo and the compilers
        trace) and the compiled code runs under it: an ``aot_eager`` graph's operators
        are seen one by one, an inductor kernel is not (NOTE [Compiled code on the
        simulator] in simulator.py)."""
        return True


class ComputeWatch(CompiledCodeMode):
    """Stamps writes of compute ops and checks them against queued copies."""

    def __init__(self, sim: SimulatedBackend) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sim = self.sim
        if sim.suspend_depth or sim.unwatched or getattr(func, "is_view", False):
            return func(*args, **kwargs)  # views touch metadata, not data; a graph capture
        if sim.current is not sim.compute:
            return sim.run_on_side_stream(func, args, kwargs)
        flat_args, _ = tree_flatten((args, kwargs))
        written_args = _mutated_args(func, args, kwargs)
        for tensor in flat_args:
            if isinstance(tensor, torch.Tensor):
                sim.check_compute_access(tensor, write=any(tensor is w for w in written_args))
        if sim.owned:  # NOTE [Allocator reuse across streams]
            sim.note_compute_use(flat_args, func)
        out = func(*args, **kwargs)
        sim.compute_seq += 1
        flat_out, _ = tree_flatten(out)
        for tensor in itertools.chain(flat_out, written_args):
            if isinstance(tensor, torch.Tensor):
                key = storage_key(tensor)
                if key is not None:
                    sim.last_write[key] = sim.compute_seq
        if sim.torn:  # a new output at a torn address is new memory (NOTE [Torn copies])
            for tensor in flat_out:
                if isinstance(tensor, torch.Tensor) and not any(tensor is w for w in written_args):
                    sim.torn.discard(storage_key(tensor))
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
        self.unwatched = False  # a CUDA graph capture runs (NOTE [Modeled CUDA graphs])
        #: held while queued copies run or are queued (NOTE [Threads])
        self.lock = threading.RLock()
        self._current = threading.local()
        #: whether a side-stream copy between non-contiguous tensors is a hazard
        #: (torch_npu synchronises such copies)
        self.contiguous_copies_only = False
        #: the blocks side streams allocated, live, and the freed ones by stream (NOTE
        #: [Allocator reuse across streams]); compute's are checked by the queued copies
        self.owned: dict[int, FreedBlock] = {}
        self.pools = StreamPools(self._ordered, "strict_streams")
        self.synced_seq = 0  # compute work the host has waited for

    @property
    def current(self) -> SimulatedStream:
        """The stream this thread's ops run on (per thread, as a device's current
        stream is); only a simulated runtime's ``stream(s)`` changes it."""
        stream: SimulatedStream = getattr(self._current, "stream", self.compute)
        return stream

    @current.setter
    def current(self, stream: SimulatedStream) -> None:
        self._current.stream = stream

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

    def forget_pending(self, copy: QueuedCopy) -> None:
        if copy.src.key is not None:
            self.pending_reads[copy.src.key] -= 1
        if copy.dst.key is not None:
            self.pending_writes[copy.dst.key] -= 1

    def check_compute_access(self, tensor: torch.Tensor, write: bool) -> None:
        key = storage_key(tensor)
        if key is None:
            return
        if self.pending_writes[key] > 0:
            self.hazard(
                f"compute {'wrote' if write else 'read'} {describe(tensor, '')} while a "
                "queued copy into it had not run: a wait for the copy's event is missing."
            )
        if write and self.pending_reads[key] > 0:
            for stream in self.streams:  # NOTE [Torn copies]
                for item in stream.queue[stream.executed :]:
                    if isinstance(item, QueuedCopy) and item.src.key == key:
                        item.torn = True

    def run_on_side_stream(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op issued while a side stream is current: copies are queued there, and
        allocations (a clone is one and a copy) take a block of that stream's pool."""
        stream = self.current
        if func in _ALLOCATIONS:
            with self.suspended():
                out = func(*args, **kwargs)
            self.allocated(out, stream)
            return out
        if func is aten.clone.default:
            with self.suspended():
                out = torch.empty_like(args[0], memory_format=kwargs.get("memory_format"))
            self.allocated(out, stream)
            self.copy(out, args[0], stream)
            return out
        if func is not aten.copy_.default:
            raise StreamHazardError(
                f"strict_streams: {func} was issued on {stream.name}; the simulator runs "
                "only copies and allocations on side streams (run other work on the "
                "compute stream)."
            )
        dst, src = args[0], args[1]
        self.copy(dst, src, stream)
        return dst

    def allocated(self, tensor: torch.Tensor, stream: SimulatedStream) -> None:
        """``tensor`` was allocated on side stream ``stream``: it may take a block of
        that stream's pool, and compute's work on it is noted until it is freed."""
        key = storage_key(tensor)
        if key is None:
            return
        storage = tensor.untyped_storage()
        what = describe(tensor, "")
        self.pools.allocate(stream, storage.nbytes(), what, stream.name)
        self.owned[key] = FreedBlock(round_size(storage.nbytes()), stream.name, what)
        weakref.finalize(storage, self._freed, key, stream).atexit = False

    def _freed(self, key: int, stream: SimulatedStream) -> None:
        block = self.owned.pop(key, None)
        if block is not None:
            self.pools.free(stream, block)

    def note_compute_use(self, tensors: list[Any], func: Any) -> None:
        """Compute's next op uses ``tensors``: noted on blocks side streams own."""
        seq = self.compute_seq + 1
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                block = self.owned.get(storage_key(tensor))  # type: ignore[arg-type]
                if block is not None:
                    block.uses[self.compute] = Use(self.compute, "compute", seq, func)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor.record_stream(stream)``: its block goes back to its pool only after
        ``stream``'s work on it (here: that work no longer makes its reuse a hazard)."""
        block = self.owned.get(storage_key(tensor))  # type: ignore[arg-type]
        if block is not None:
            block.uses.pop(cast(Hashable, stream), None)

    def _ordered(self, use: Use, stream: Hashable) -> bool:
        if use.stream is not self.compute or use.stream is stream:
            return True  # other side streams' queued copies: checked when they run
        waited = cast(SimulatedStream, stream).waited_compute_seq
        return max(waited, self.synced_seq) >= use.seq

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
            stream.queue.append(QueuedWait(source, event.position))

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        event = self.new_event()
        event.record(cast(SimulatedStream, other))
        self.wait_event(stream, event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, label: str = "") -> None:
        with self.lock:
            self._copy(dst, src, stream, label)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, label: str) -> None:
        if stream.is_compute:
            self.check_compute_access(src, write=False)
            self.check_compute_access(dst, write=True)
            with self.suspended():
                dst.copy_(src)
            return
        if self.contiguous_copies_only and not (src.is_contiguous() and dst.is_contiguous()):
            self.hazard(
                f"a copy of {describe(src, label)} with strides {src.stride()} into strides "
                f"{dst.stride()} was issued on {stream.name}: torch_npu copies between "
                "non-contiguous tensors through pageable memory and synchronises the host."
            )
        item = QueuedCopy(self, dst, src, label)
        src_key, dst_key = item.src.key, item.dst.key
        if src_key is not None and self.last_write.get(src_key, 0) > stream.waited_compute_seq:
            self.hazard(
                f"a copy of {describe(src, label)} was issued on {stream.name} before that "
                "stream waited for the compute work that wrote it (a missing wait on the "
                "tensor's ready event)."
            )
        if dst_key is not None and (self.pending_reads[dst_key] or self.pending_writes[dst_key]):
            self.hazard(
                f"a copy into {describe(dst, label)} was issued while an earlier queued "
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
        key = storage_key(tensor)
        if key is not None and self.pending_writes[key] > 0:
            self.hazard(
                f"{describe(tensor, label)} was handed back to autograd while the copy "
                "that reloads it was still queued (a missing wait on its reload event)."
            )
        if key in self.torn:
            self.hazard(
                f"{describe(tensor, label)} was handed back to autograd holding torn data: "
                "a copy it came from read its source while compute was writing it (the "
                "tensor was modified in place after its offload started, and the unpack "
                "did not refuse it)."
            )

    def synchronize(self) -> None:
        self.counters.synchronizations += 1
        self.synced_seq = self.compute_seq
        for stream in self.streams:
            stream.run_until(len(stream.queue))

    def queued_copies(self) -> int:
        """Copies issued but not run yet, over all streams."""
        return sum(
            1
            for stream in self.streams
            for item in stream.queue[stream.executed :]
            if isinstance(item, QueuedCopy)
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
