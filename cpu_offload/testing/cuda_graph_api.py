"""``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` on the modeled accelerator: capture
begins and ends a :class:`~cpu_offload.testing.cuda_graphs.Capture`, replay re-issues
its record on the clocks (NOTE [Modeled CUDA graphs] in cuda_graphs.py)."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Protocol

from .allocator_pools import StreamOrder
from .clocks import StreamClock, Timeline
from .cuda_graphs import INVALIDATED, MODES, UNJOINED, UNMATCHED, Capture, CaptureError, GraphPool
from .device_memory import DeviceMemory
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

    def Stream(self, device: Any = None, priority: int = 0) -> TimedStream: ...  # noqa: N802

    def stream(self, stream: TimedStream | None) -> contextlib.AbstractContextManager[None]: ...

    def synchronize(self, device: Any = None) -> None: ...

    def empty_pinned_cache(self) -> None: ...

    def graph_pool(self, handle: tuple[int, int] | None) -> GraphPool: ...


_graph_ids = itertools.count(1)


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
        if runtime.strict is not None:
            raise RuntimeError(
                "capture_begin: CUDA graphs are modeled shapes only (timed_runtime(data=False))."
            )
        stream = runtime.current
        if stream is runtime.compute:
            raise RuntimeError(
                "capture_begin: the current stream is the default stream; CUDA graphs are "
                "captured on a side stream (torch.cuda.graph makes one) and may be "
                "replayed on any stream."
            )
        self.graph_pool = runtime.graph_pool(pool)
        self.graph_pool.users += 1
        runtime.timeline.capture = Capture(
            stream,
            runtime.compute.clock,
            capture_error_mode,
            self.graph_pool,
            runtime.memory.in_graph_pool,
        )

    def capture_end(self) -> None:
        runtime = self.runtime
        capture = runtime.timeline.capture
        if capture is None:
            raise RuntimeError("capture_end: no capture is under way.")
        runtime.timeline.capture = None
        assert self.graph_pool is not None
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
        self.nodes = capture.nodes
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
        launch = runtime.current.clock
        clocks = [launch, *self.branches]
        times: dict[int, float] = {}
        with timeline.graph_launch():
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
                elif kind == "wait":
                    timeline.wait(clock, times[node[2]], "wait in the graph")
                elif kind == "external wait":
                    timeline.wait(clock, node[2].time, "external wait")
                else:
                    node[2].time = timeline.now(clock)
        runtime.order.tick(launch)
        self.replays += 1

    def reset(self) -> None:
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
