"""``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` on the modeled accelerator: capture
begins and ends a :class:`~cpu_offload.testing.cuda_graphs.Capture`, replay re-issues
its record on the clocks (NOTE [Modeled CUDA graphs] in cuda_graphs.py).

NOTE [Data-mode replay]
    With ``timed_runtime(data=True)`` a capture also records the operators its streams
    run (:class:`_Recorder`, a ``TorchDispatchMode`` above the timing): the operator and
    the very tensors it was given and returned.  The capture runs them, to make its
    tensors, with the strict simulator looking away; at ``capture_end`` it undoes what a
    capture never does: memory that existed before it and that captured work wrote is
    restored, and the tensors it made hold poison (NaN, or the byte ``0xA5``) until a
    replay fills them.  A replay runs the operators again, in order, on the same tensor
    objects, without autograd: an in-place operator writes its arguments again, a
    fresh output is copied into the tensor the capture returned (views alias it), and
    each runs on its stream of the strict simulator (the launch stream, or a branch),
    whose events the captured records and waits drive, so every hazard of NOTE [Strict
    stream simulation] is checked at each replay.  What it cannot do: random operators
    draw new numbers (CUDA's graph-safe generators advance an offset instead), the
    graph keeps every tensor its record uses (the pool's reserve then counts them all),
    and host work the capture ran (operators on host memory) is not replayed, as on a
    device.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..device.backend import is_dense
from ..device.kernel_costs import ALIASES, ALLOCATIONS, storage_id, tensors_in
from .allocator_pools import StreamOrder
from .clocks import StreamClock, Timeline
from .cuda_graphs import INVALIDATED, MODES, UNJOINED, UNMATCHED, Capture, CaptureError, GraphPool
from .device_memory import DeviceMemory
from .sim_streams import SimulatedEvent
from .timed_streams import TimedStream

__all__ = ["GraphRuntime", "ModeledGraph", "graph_api"]


class GraphRuntime(Protocol):
    """What graphs ask of the runtime they belong to (``timed_device.TimedRuntime``)."""

    timeline: Timeline
    memory: DeviceMemory
    order: StreamOrder
    current: TimedStream
    compute: TimedStream
    strict: Any  # the strict simulator of the data mode, or None
    replaying: bool  # operators run uncharged (a data-mode replay)

    def Stream(self, device: Any = None, priority: int = 0) -> TimedStream: ...  # noqa: N802

    def stream(self, stream: TimedStream | None) -> contextlib.AbstractContextManager[None]: ...

    def synchronize(self, device: Any = None) -> None: ...

    def empty_pinned_cache(self) -> None: ...

    def graph_pool(self, handle: tuple[int, int] | None) -> GraphPool: ...


_graph_ids = itertools.count(1)


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes (its schema's mutable aliases)."""
    schema = getattr(func, "_schema", None)
    found = []
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            found.extend(tensors_in(value))
    return found


def _poison(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    elif is_dense(tensor):
        flat = tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
        flat.view(torch.uint8).fill_(0xA5)


class _Recorder(TorchDispatchMode):
    """The operators a data-mode capture runs, for replays to run again (NOTE
    [Data-mode replay])."""

    def __init__(self, runtime: GraphRuntime, capture: Capture) -> None:
        super().__init__()
        self.runtime, self.capture = runtime, capture
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.made: set[int | None] = set()  # storages the captured operators made

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        capture, strict = self.capture, self.runtime.strict
        index = capture.streams.get(self.runtime.current.clock)
        if index is None or strict.suspend_depth or func.is_view or func in ALIASES:
            return func(*args, **kwargs)
        saved = {}  # what it writes of older memory, as it was
        for tensor in _written(func, args, kwargs):
            key = storage_id(tensor)
            if key is not None and key not in self.made and key not in self.saved:
                with strict.suspended():
                    storage = tensor.untyped_storage()
                    saved[key] = (storage, storage.clone())
        before = len(capture.nodes)
        out = func(*args, **kwargs)
        if len(capture.nodes) > before:  # device work (a kernel or a copy), not host work
            self.saved.update(saved)
            capture.nodes.append(("op", index, func, args, kwargs, out))
            given = {storage_id(t) for t in tensors_in(kwargs, tensors_in(args))}
            self.made.update(k for k in map(storage_id, tensors_in(out)) if k not in given)
        return out

    def undo(self) -> None:
        """What a capture never does: older memory it wrote is restored, and the
        tensors it made hold poison until a replay."""
        with self.runtime.strict.suspended():
            for storage, before in self.saved.values():
                storage.copy_(before)
            for node in self.capture.nodes:
                if node[0] == "op":
                    for tensor in tensors_in(node[5]):
                        if storage_id(tensor) in self.made:
                            _poison(tensor)


class ModeledGraph:
    """``torch.cuda.CUDAGraph`` on a :class:`TimedRuntime` (``runtime.CUDAGraph`` is a
    subclass bound to one runtime)."""

    runtime: GraphRuntime

    def __init__(self, keep_graph: bool = False) -> None:
        self.nodes: list[tuple[Any, ...]] | None = None
        self.branches: list[StreamClock] = []
        self.graph_pool: GraphPool | None = None
        self.replays = 0
        self._release: weakref.finalize | None = None
        self._recorder: _Recorder | None = None
        self.inner_branches: list[Any] = []  # the strict simulator's streams (data mode)
        self.touched: set[int] = set()  # the storages its work uses
        self.number = 0

    def capture_begin(
        self,
        pool: tuple[int, int] | None = None,
        capture_error_mode: str = "global",
        check_input_liveness: bool = False,
    ) -> None:
        runtime = self.runtime
        if capture_error_mode not in MODES:
            raise ValueError(f"capture_begin: capture_error_mode must be one of {MODES}.")
        if runtime.timeline.capture is not None:
            raise RuntimeError("capture_begin: a capture is already under way (one at a time).")
        if self.nodes is not None:
            raise RuntimeError("capture_begin: this graph holds a capture; reset() it first.")
        stream = runtime.current
        if stream is runtime.compute:
            raise RuntimeError(
                "capture_begin: the current stream is the default stream; CUDA graphs are "
                "captured on a side stream (torch.cuda.graph makes one) and may be "
                "replayed on any stream."
            )
        self.graph_pool = runtime.graph_pool(pool)
        self.graph_pool.users += 1
        capture = Capture(
            stream,
            runtime.compute.clock,
            capture_error_mode,
            self.graph_pool,
            runtime.memory.in_graph_pool,
        )
        runtime.timeline.capture = capture
        if runtime.strict is not None:  # NOTE [Data-mode replay]
            runtime.strict.unwatched = True
            self._recorder = _Recorder(runtime, capture)
            self._recorder.__enter__()

    def capture_end(self) -> None:
        runtime = self.runtime
        capture = runtime.timeline.capture
        if capture is None:
            raise RuntimeError("capture_end: no capture is under way.")
        runtime.timeline.capture = None
        assert self.graph_pool is not None
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
            runtime.strict.unwatched = False
            recorder.undo()
        error = None
        if runtime.current is not capture.origin:
            error = CaptureError(
                UNMATCHED,
                f"capture_end on {runtime.current.clock.name}; the capture began on "
                f"{capture.origin.clock.name}.",
            )
        elif capture.invalid is not None:
            error = CaptureError(
                INVALIDATED,
                f"the capture was invalidated by an earlier {capture.invalid.kind} (raised "
                "during the capture); capture again without it.",
            )
        elif unjoined := capture.unjoined():
            error = CaptureError(
                UNJOINED,
                f"{', '.join(unjoined)} forked from the capture and issued work the "
                f"capture stream {capture.origin.clock.name} never waited for. Join it "
                "before the capture ends: capture_stream.wait_stream(side).",
            )
        if error is not None:
            self.graph_pool.release(runtime.timeline.now(capture.origin.clock))
            self.graph_pool = None
            raise error
        number = next(_graph_ids)
        timeline = runtime.timeline
        self.branches = [
            timeline.new_stream(f"graph {number}: {clock.name}") for clock in capture.clocks[1:]
        ]
        self.nodes, self.touched, self.number = capture.nodes, capture.touched, number
        if runtime.strict is not None:
            self.inner_branches = [runtime.strict.new_stream() for _ in self.branches]
        pool, compute = self.graph_pool, runtime.compute.clock
        self._release = weakref.finalize(self, lambda: pool.release(timeline.now(compute)))

    def replay(self) -> None:
        """One ``cudaGraphLaunch`` on the current stream (NOTE [Modeled CUDA graphs])."""
        runtime = self.runtime
        timeline = runtime.timeline
        if self.nodes is None:
            raise RuntimeError("CUDAGraph.replay: nothing captured (capture_begin/capture_end).")
        if timeline.capture is not None:
            raise RuntimeError("CUDAGraph.replay inside a capture is not modeled.")
        strict = runtime.strict
        previous, runtime.replaying = (strict.current if strict else None), True
        try:
            self._replay(runtime.current)
        finally:
            runtime.replaying = False
            if strict is not None:
                strict.current = previous
        launch = runtime.current.clock
        seq = runtime.order.tick(launch)
        runtime.memory.replayed(self.touched, launch, seq, f"replay of graph {self.number}")
        self.replays += 1

    def _replay(self, on: TimedStream) -> None:
        """The record on the clocks, and in the data mode its operators again."""
        timeline, strict = self.runtime.timeline, self.runtime.strict
        assert self.nodes is not None
        launch = on.clock
        clocks, inners = [launch, *self.branches], [on.inner, *self.inner_branches]
        times: dict[int, float] = {}
        events: dict[int, SimulatedEvent] = {}
        with timeline.graph_launch(), torch.no_grad():
            start = timeline.now(launch)
            for branch in self.branches:
                branch.time = max(branch.time, start)
            for node in self.nodes:
                kind, clock = node[0], clocks[node[1]]
                if kind == "kernel":
                    timeline.kernel(clock, node[2], node[3])
                elif kind == "copy":
                    timeline.copy(clock, node[2], node[3], True, node[4])
                elif kind == "record":
                    times[node[2]] = timeline.now(clock)
                    if strict is not None:
                        events[node[2]] = SimulatedEvent(strict)
                        events[node[2]].record(inners[node[1]])
                elif kind == "wait":
                    timeline.wait(clock, times[node[2]], "wait in the graph")
                    if strict is not None:
                        strict.wait_event(inners[node[1]], events[node[2]])
                elif kind == "op":
                    strict.current = inners[node[1]]
                    _run_again(*node[2:])
                elif kind == "external wait":
                    timeline.wait(clock, node[2].time, "external wait")
                else:
                    node[2].time = timeline.now(clock)

    def reset(self) -> None:
        self.inner_branches = []
        if self._release is not None:
            self._release()
        self.nodes, self.branches, self.graph_pool, self._release = None, [], None, None

    def pool(self) -> tuple[int, int]:
        if self.graph_pool is None:
            raise RuntimeError("CUDAGraph.pool: the graph has no pool before capture_begin.")
        return self.graph_pool.handle

    def instantiate(self) -> None:
        """The graph is instantiated at capture_end (``keep_graph`` is not modeled)."""

    def enable_debug_mode(self) -> None:
        """Nothing to dump in the model."""


def _run_again(func: Any, args: Any, kwargs: Any, out: Any) -> None:
    """A captured operator again: in-place ones write their arguments again; a fresh
    output is copied into the one the capture returned."""
    fresh = func(*args, **kwargs)
    if func in ALLOCATIONS:
        return
    for old, new in zip(tensors_in(out), tensors_in(fresh)):
        if storage_id(old) != storage_id(new):
            old.copy_(new)


def graph_api(runtime: GraphRuntime) -> tuple[type[ModeledGraph], type[Any]]:
    """``CUDAGraph`` and ``graph`` bound to ``runtime`` (what ``run.live`` exposes)."""
    bound = type("CUDAGraph", (ModeledGraph,), {"runtime": runtime})

    class graph:  # noqa: N801 (torch.cuda.graph's name)
        """``torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode)`` on the
        runtime: synchronises, empties the pinned cache, captures on ``stream`` (a side
        stream of its own by default) and ends the capture when the block ends."""

        default_capture_stream: TimedStream | None = None

        def __init__(
            self,
            cuda_graph: ModeledGraph,
            pool: tuple[int, int] | None = None,
            stream: TimedStream | None = None,
            capture_error_mode: str = "global",
        ) -> None:
            if stream is None:
                if graph.default_capture_stream is None:
                    graph.default_capture_stream = runtime.Stream()
                stream = graph.default_capture_stream
            self.cuda_graph, self.pool, self.mode = cuda_graph, pool, capture_error_mode
            self.stream_ctx = runtime.stream(stream)

        def __enter__(self) -> None:
            runtime.synchronize()
            runtime.empty_pinned_cache()
            self.stream_ctx.__enter__()
            self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.mode)

        def __exit__(self, *exc: object) -> None:
            try:
                self.cuda_graph.capture_end()
            finally:
                self.stream_ctx.__exit__(None, None, None)

    return bound, graph
