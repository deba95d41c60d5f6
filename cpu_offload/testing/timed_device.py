"""A modeled accelerator: a simulated ``torch.cuda`` / ``torch.npu`` with clocks and an
allocator count, that the real offload code (``StreamBackend``) runs on.

NOTE [Modeled accelerator]
    :class:`TimedRuntime` is the slice of the runtime module ``StreamBackend`` calls
    (as ``SimulatedRuntime`` is), and :class:`OpTiming` a ``TorchDispatchMode`` that sees
    every operator the program runs.  Each operator is charged to the current stream
    as a kernel of its roofline time (``kernel_costs.kernel_cost``, the profile's
    ``kernel_seconds``), or as a copy when it is ``copy_`` between device and host
    memory; every storage it creates is counted as the caching allocator counts it.
    Streams, events, waits and synchronisations move the clocks as CUDA does (NOTE
    [Modeled clocks] in clocks.py, NOTE [Modeled device memory] in device_memory.py).

    Two modes.  *Shapes only* (the default): "device" tensors are meta tensors, and so
    is host memory (a tensor allocated on the CPU is made on the meta device and
    remembered as host memory, pinned or pageable), so a Llama-3-8B step at full scale
    runs in about a second; ``scaled_dot_product_attention`` and dropout run the kernels
    a device runs (``device_kernels.DeviceKernels``).  *Data* (``data=True``): tensors
    are CPU tensors, the strict simulator runs underneath (NOTE [Strict stream
    simulation]) so every hazard still raises, and the CPU's own kernels run.

    The model knows nothing of the offloader: it sees operators, streams, events and
    storages, as a device would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..device.kernel_costs import ALIASES, kernel_cost, memory_bytes, storage_id, tensors_in
from ..device.kernels import DeviceKernels
from ..device.pinned_sizes import THRESHOLD_MB
from ..device.profiles import DeviceProfile, get_profile
from ..device.runtime import StreamBackend, override_host_backend
from .clocks import Timeline
from .cuda_graph_api import graph_api
from .cuda_graphs import GraphPool
from .device_memory import DeviceMemory, MemoryMark
from .runtime import FLAVOURS, SyncDebugMode
from .simulator import CompiledCodeMode, ComputeWatch, SimulatedBackend, SimulatedEvent
from .timed_report import TimedReport
from .timed_streams import TimedEvent, TimedStream

__all__ = ["OpTiming", "TimedRuntime", "timed_runtime"]

aten = torch.ops.aten
_META = torch.device("meta")


class TimedRuntime(SyncDebugMode):
    """The parts of ``torch.cuda`` (or ``torch.npu``) that StreamBackend uses, modeled.

    Args:
        profile: the device's figures.
        flavour: ``"cuda"`` or ``"npu"`` (see NOTE [Simulated runtime]).
        strict: the strict simulator to drive as well (the data mode), or None.
        record: log every kernel, copy and wait (for traces and plots).
    """

    sync_warning_stacklevel = 4  # the copy's call is one frame deeper

    def __init__(
        self,
        profile: DeviceProfile,
        flavour: str = "cuda",
        strict: SimulatedBackend | None = None,
        record: bool = True,
    ) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"TimedRuntime: flavour must be 'cuda' or 'npu', got {flavour!r}.")
        self.profile = profile
        self.flavour = flavour
        self.strict = strict
        if strict is not None:
            strict.contiguous_copies_only = flavour == "npu"
        self.device = torch.device("cpu") if strict is not None else _META
        self.timeline = Timeline(profile, record)
        self.clocks: dict[int, Any] = {}
        self.memory = DeviceMemory(self.timeline, self.clocks)
        self.order = self.memory.order  # what each stream's work is ordered after
        self.compute = self._stream("compute", True, strict.compute if strict else None)
        self.current = self.compute
        # CUDA graphs (NOTE [Modeled CUDA graphs]): torch.cuda.CUDAGraph and graph
        self.CUDAGraph, self.graph = graph_api(self)
        self.graph_pools: dict[tuple[int, int], GraphPool] = {}
        self.replaying = False  # a data-mode replay re-executes its operators uncharged

    def _stream(self, name: str, is_compute: bool, inner: Any) -> TimedStream:
        stream = TimedStream(self, self.timeline.new_stream(name, is_compute), inner)
        self.clocks[stream.stream_id] = stream.clock
        return stream

    # -- streams and events
    def Stream(self, device: Any = None, priority: int = 0) -> TimedStream:  # noqa: N802
        inner = self.strict.new_stream() if self.strict is not None else None
        return self._stream(f"side stream {len(self.clocks)}", False, inner)

    def Event(  # noqa: N802
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> TimedEvent:
        inner = SimulatedEvent(self.strict) if self.strict is not None else None
        return TimedEvent(self, inner, external)

    def current_stream(self, device: Any = None) -> TimedStream:
        return self.current

    # -- the pinned allocator's setting, for this run only (NOTE [Pinned sizes as torch
    # holds them]: on a GPU the host pool sets it for the process)
    def exact_pinned_sizes(self) -> int | None:
        pinned = self.memory.pinned
        if pinned.threshold is None:
            pinned.threshold = THRESHOLD_MB << 20
        return pinned.threshold

    def empty_pinned_cache(self) -> None:
        self.memory.pinned.empty_cache()

    @contextlib.contextmanager
    def stream(self, stream: TimedStream | None) -> Iterator[None]:
        """Make ``stream`` current inside the block, as ``torch.cuda.stream`` does."""
        previous = self.current
        if stream is not None:
            self.current = stream
            if self.strict is not None:
                self.strict.current = stream.inner
        try:
            yield
        finally:
            self.current = previous
            if self.strict is not None:
                self.strict.current = previous.inner

    def wait_event(self, stream: TimedStream, event: TimedEvent) -> None:
        capture = self.timeline.capture
        if capture is not None and capture.wait(stream, event):
            self.order.wait(stream.clock, event.stamp)
            return
        if event.captured is not None:  # recorded in a capture that has ended
            raise event.captured[0].used_after(f"a wait by {stream.clock.name}")
        source = event.stream
        if source is not None and source is not stream:
            self.timeline.wait(stream.clock, event.time, f"wait for {source.clock.name}")
            self.order.wait(stream.clock, event.stamp)
        if self.strict is not None and event.inner is not None:
            self.strict.wait_event(stream.inner, event.inner)

    def synchronize(self, device: Any = None) -> None:
        if self.timeline.capture is not None:
            self.timeline.capture.sync("torch.cuda.synchronize()", None)
        self.host_wait(self.timeline.end(), "synchronize()")
        self.order.host_saw_all()
        if self.strict is not None:
            self.strict.synchronize()

    def host_wait(self, time: float, what: str) -> None:
        """The host stalls until ``time``; the sync debug mode hears of it."""
        self._on_sync(what)
        self.timeline.host_wait(time, what)
        if self.memory.deferred:
            self.memory.poll()

    # -- CUDA graphs (NOTE [Modeled CUDA graphs]; CUDAGraph and graph are set in __init__)
    def is_current_stream_capturing(self) -> bool:
        """Whether the current stream is capturing (an invalidated capture still is)."""
        capture = self.timeline.capture
        return capture is not None and self.current.clock in capture.streams

    def graph_pool_handle(self) -> tuple[int, int]:
        """A new memory pool's id, for graphs to share (``pool=``)."""
        handle = (0, len(self.graph_pools) + 1)
        self.graph_pool(handle)
        return handle

    def graph_pool(self, handle: tuple[int, int] | None) -> GraphPool:
        """The pool of ``handle`` (a new one for None)."""
        if handle is None:
            handle = (len(self.graph_pools) + 1, 0)
        pool = self.graph_pools.get(handle)
        if pool is None:
            pool = self.graph_pools[handle] = GraphPool(handle, self.memory.change)
        return pool

    # -- the device
    def is_available(self) -> bool:
        return True

    def current_device(self) -> int | None:
        return 0 if self.device.type == "cpu" else None  # the meta device has no index

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device: Any = None) -> str:
        return f"modeled {self.profile.name}"

    # -- memory statistics, from the model's allocator count
    def memory_allocated(self, device: Any = None) -> int:
        return self.memory.allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.memory.peak_since_reset

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.memory.peak_since_reset = self.memory.allocated

    def backend(self) -> StreamBackend:
        """A :class:`StreamBackend` on this runtime, with pinned host buffers."""
        return StreamBackend(self.device, self, runtime_type=self.flavour, pin_memory=True)

    # -- what operators cost (called by OpTiming)
    def placement(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
        """A factory's keyword arguments as the model runs it, and whether it allocates
        host memory, pinned: host memory is made on the meta device when shapes only,
        and never pinned for real (this machine may have no accelerator)."""
        device, pin = kwargs.get("device"), bool(kwargs.get("pin_memory"))
        if self.strict is None:
            if device is not None and torch.device(device).type == "cpu":
                return {**kwargs, "device": _META, "pin_memory": False}, True, pin
            return kwargs, False, False
        if pin:
            return {**kwargs, "pin_memory": False}, True, True
        return kwargs, False, False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Charge ``dst.copy_(src)`` to the current stream: a device-to-host, host-to-
        device or device-to-device copy (nothing, between host tensors)."""
        memory = self.memory
        dst_block, src_block = memory.block(dst), memory.block(src)
        to_host = dst_block is not None and dst_block.host
        from_host = src_block is not None and src_block.host
        if to_host and from_host:
            return
        direction = "d2h" if to_host else "h2d" if from_host else "d2d"
        host_block = dst_block if to_host else src_block
        pinned = host_block is not None and host_block.pinned
        if self.flavour == "npu" and not (dst.is_contiguous() and src.is_contiguous()):
            pinned = False  # torch_npu stages it through pageable memory
        self.transfer(direction, memory_bytes(src), pinned, (dst, src))

    def transfer(self, direction: str, nbytes: int, pinned: bool, tensors: Any = ()) -> None:
        """A copy of ``nbytes`` on the current stream (``"d2h"``, ``"h2d"``, ``"d2d"``)
        between ``tensors`` (destination first, when known)."""
        capture = self.timeline.capture
        if capture is not None:
            capture.transfer(self.current.clock, direction, pinned)
            capture.issue(self.current.clock, f"a {direction} copy", tensors, tensors[:1])
        if direction != "d2d" and not pinned:
            self._on_sync(f"a {direction} copy with pageable memory")
        clock = self.current.clock
        self.timeline.copy(clock, direction, nbytes, pinned, nbytes)
        if direction != "d2d" and not pinned:  # the host waited for it
            order = self.memory.order
            order.host_saw({**order.stamp(clock), clock: order.issued.get(clock, 0) + 1})

    # -- what the program tells the report (TimedReport.mark, TimedReport.begin)
    def mark(self, label: str, not_counted: Iterable[Any]) -> MemoryMark:
        return self.memory.mark(label, not_counted, self.compute.clock)

    def begin(self, phase: str) -> None:
        self.timeline.phase = phase


class OpTiming(CompiledCodeMode):
    """Charges every operator to the modeled accelerator (NOTE [Modeled accelerator])."""

    def __init__(self, runtime: TimedRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        runtime = self.runtime
        strict = runtime.strict
        if (strict is not None and strict.suspend_depth) or func.is_view or func in ALIASES:
            return func(*args, **kwargs)  # the simulator's own copies; metadata only
        if runtime.replaying:  # a graph's replay: its record is charged (cuda_graph_api.py)
            return func(*args, **kwargs)
        if func is aten.record_stream.default:
            runtime.memory.record_stream(args[0], args[1].stream_id)
            return None
        host = pinned = False
        if "device" in kwargs or kwargs.get("pin_memory"):
            kwargs, host, pinned = runtime.placement(kwargs)
        clock = runtime.current.clock
        timeline = runtime.timeline
        memory = runtime.memory
        if func is aten.copy_.default:
            runtime.copy(args[0], args[1])
            seq = memory.order.tick(clock)
            memory.use(args[0], clock, seq, "copy into")
            memory.use(args[1], clock, seq, "copy from")
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:  # .item(): the host waits for the value
            if timeline.capture is not None:
                timeline.capture.sync("Tensor.item()", clock)
            runtime.host_wait(clock.time, "reading a value from the device")
            memory.order.host_saw(memory.order.stamp(clock))
        out = func(*args, **kwargs)
        inputs = tensors_in(kwargs, tensors_in(args))
        outputs = tensors_in(out)
        seq = memory.order.tick(clock)
        for tensor in inputs:
            memory.use(tensor, clock, seq, func)
        placed = kwargs.get("device") is not None  # where its output goes is said
        if not host and inputs and not placed:  # an operator on host memory runs on the host
            host = all(b is not None and b.host for b in map(memory.block, inputs))
        cost = None
        source = memory.block(args[0]) if placed and func is aten._to_copy.default else None
        if source is not None and source.host != host:  # .to("cpu"), .to(device): a copy
            side = source.pinned if source.host else pinned
            runtime.transfer(
                "h2d" if source.host else "d2h", memory_bytes(args[0]), side, (out, args[0])
            )
        elif source is None and placed and func is aten._to_copy.default and host:  # to the host
            runtime.transfer("d2h", memory_bytes(args[0]), pinned, (out, args[0]))
        elif not host:
            cost = kernel_cost(func, args, kwargs, out, inputs, outputs)
        if cost is not None:
            if timeline.capture is not None:
                timeline.capture.issue(clock, func, [*inputs, *outputs], outputs)
            start = timeline.kernel(clock, runtime.profile.kernel_seconds(*cost), func)
        else:
            start = timeline.now(clock)
        blocks = memory.blocks
        given: set[int | None] | None = None
        for tensor in outputs:
            key = storage_id(tensor)
            if key is None or key in blocks:
                continue
            if given is None:
                given = {storage_id(t) for t in inputs}
            if key not in given and tensor.untyped_storage().nbytes():
                memory.track(tensor, clock, start, host, pinned)
        return out


@contextlib.contextmanager
def timed_runtime(
    profile: str | DeviceProfile = "h100",
    *,
    flavour: str | None = None,
    data: bool = False,
    record: bool = True,
) -> Iterator[TimedReport]:
    """Run the block on a modeled accelerator; yields its :class:`TimedReport`, whose
    figures are filled in when the block ends (NOTE [Modeled accelerator]).

    Offload contexts created inside the block (on the default device) use
    ``StreamBackend`` on a :class:`TimedRuntime`.  Build the model and its inputs before
    the block (what they allocate is not counted), on ``report.device``: the meta device
    when shapes only, the CPU with ``data=True``.

    Args:
        profile: a device profile's name (``"h100"``, ``"910b"``, ...), a JSON file of
            ``python -m cpu_offload.check``, or a ``DeviceProfile``.
        flavour: ``"cuda"`` or ``"npu"``; the profile's runtime by default.
        data: compute real data under the strict simulator (every hazard raises) instead
            of shapes only.
        record: log every kernel, copy and wait (for ``write_trace`` and plots).

    Example:
        >>> import torch
        >>> from cpu_offload import get_cpu_offload_context
        >>> from cpu_offload.testing import timed_runtime
        >>> layers = [torch.nn.Linear(4096, 4096, device="meta") for _ in range(3)]
        >>> x = torch.empty(8192, 4096, device="meta", requires_grad=True)
        >>> with timed_runtime("h100") as run:
        ...     ctx, sync_fn = get_cpu_offload_context(True, 1, 3)
        ...     for layer in layers:
        ...         with ctx:
        ...             x = layer(x).relu()
        ...         x = sync_fn(x)
        ...     x.sum().backward()
        >>> run.d2h_bytes == run.h2d_bytes == 2 * 8192 * 4096 * 4  # layer 0: input, relu output
        True
        >>> 0 < run.compute_s <= run.step_s
        True
    """
    chosen = get_profile(profile)
    runtime = TimedRuntime(
        chosen, flavour or chosen.runtime, SimulatedBackend() if data else None, record
    )
    report = TimedReport(chosen, runtime.flavour, runtime.device, data)
    memory = runtime.memory
    report.live = runtime
    with contextlib.ExitStack() as stack:
        stack.enter_context(override_host_backend(runtime.backend))
        if runtime.strict is not None:
            stack.enter_context(ComputeWatch(runtime.strict))
        stack.enter_context(OpTiming(runtime))
        if runtime.strict is None:  # the kernels a device runs (NOTE [Modeled accelerator])
            stack.enter_context(DeviceKernels("flash", fused_dropout=True).patched())
        try:
            yield report
        finally:
            report.live = None
    runtime.timeline.host = runtime.timeline.end()  # the block's work completes
    memory.poll()
    if runtime.strict is not None:
        runtime.strict.synchronize()  # queued copies run (and may raise)
    _fill(report, runtime)


def _fill(report: TimedReport, runtime: TimedRuntime) -> None:
    timeline, memory, compute = runtime.timeline, runtime.memory, runtime.compute.clock
    report.step_s = timeline.host
    report.compute_s = compute.busy_s
    report.exposed_copy_s = compute.waited_s + compute.copy_s
    report.host_bound_s = compute.host_bound_s
    report.host_sync_s = timeline.host_sync_s
    report.host_syncs = timeline.host_syncs
    report.d2h_bytes, report.h2d_bytes = timeline.copied["d2h"], timeline.copied["h2d"]
    report.peak_bytes, report.end_bytes = memory.peak, memory.allocated
    report.host_peak_bytes = memory.host_peak
    report.block_reuses = memory.pools.reuses
    report.pinned_reserved_bytes = memory.pinned.peak_reserved
    report.pinned_allocations = memory.pinned.allocations
    report.marks, report.curve = memory.marks, memory.curve
    report.streams, report.host_log = timeline.streams, timeline.host_log
    memory.close()
