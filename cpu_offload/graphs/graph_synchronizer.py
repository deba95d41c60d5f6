"""The default schedule inside CUDA graphs: a captured step whose replays repeat its copies.

NOTE [A captured step]
    Capture records what the streams are given and runs nothing; a replay re-issues the
    record without Python.  So, with ``cuda_graph`` (NOTE [Graph shapes] in
    graph_options.py):

    * Host buffers are fixed: each layer keeps its pinned buffers for the next passes
      (the pool's ``retain`` mode), allocated in the eager warm-up steps before the
      capture (or during it where the device allows: torch 2.11 and later), never
      lent to another layer while a graph that copies into them may replay; the sets a
      capture took are the graph's alone (an eager pass gets its own: a replay would
      overwrite what an eager pass in flight offloaded).  A captured copy is not timed.
    * Device buffers of a reload are allocated on the capturing stream, from the
      graph's pool.  Popped on another stream (a layer whose ops run on a side stream
      joined to the capture), they are handed to ``record_stream`` for it, as in eager:
      PyTorch's allocator honours it during a capture by keeping the block out of the
      capture's reuse until the capture ends, where without it the capture would bake
      in a reuse of memory the other stream still reads.
    * The copy stream forks from the capturing stream (it waits for an event recorded
      there before each copy, as in eager) and joins it, as in eager: the capturing
      stream waits for a layer's offload before its device memory is released, for its
      reload at its first unpack, and for every copy in flight when backward releases
      the layer.  In ``"layer"`` graphs a layer's offload is released at the end of its
      own forward and its reload issued as its own backward starts, so both are joined
      in the layer's graphs; in ``"step"`` graphs, by the end of the step's backward.
    * Nothing but the captured work decides per step: no host synchronisation, no
      allocation after the warm-up, the schedule fixed by the layer indices.
    * In ``"step"`` graphs a forward pass is captured whole or not at all: a layer
      entered inside a capture in a pass that began outside one (or the reverse) is
      refused with the offloader's own error, which names ``cuda_graph="layer"``,
      before its copies cross the capture's boundary (into a capture, CUDA refuses
      the wait on an event recorded outside, cudaErrorStreamCaptureIsolation; out of
      one, it runs eager copies of memory only a replay fills).  Per-layer graphs of
      a whole model under ``"step"`` fail earlier, with CUDA's
      cudaErrorStreamCaptureUnjoined at the first graph's end: the offloader does not
      run when a capture ends, and torch says only whether the current stream
      captures, not which capture, so it cannot tell one layer's graph from a step's.
    * An event recorded during a capture is a node of that graph: nothing outside it
      may wait for it (CUDA refuses: cudaErrorCapturedEvent, pytorch#192000), and
      nothing needs to, since a replay ends with its copies joined to the stream it
      was launched on and a failed capture ran nothing.  So where the layer's data
      goes outside the capture that copied it (its graph dropped, its pass freed after
      a failed capture), the waits on such events are not made.

    Steps are told apart for the report (NOTE [What a replay reports] in
    report/graph_report.py): eager steps before the first capture are warm-up steps;
    a step whose backward ended under capture is captured; after a capture, a step
    whose layers saved nothing went through graphed layers (their forward is a replay,
    saving nothing for autograd) and counts as a replay, not as a step of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch

from ..device.backend import DeviceBackend, Event, Stream
from ..engine.forward_pass import ForwardPass
from ..engine.host_buffers import HostBufferPool
from ..engine.synchronizer import DefaultOffloadSynchronizer
from ..engine.transitions import LayerState
from ..errors import CpuOffloadError
from ..log import warn
from ..report.graph_report import GraphStepReport, GraphSteps
from ..report.step_record import StepRecord
from ..report.step_report import StepReport

__all__ = ["PINNED_IN_CAPTURE", "CaptureBackend", "GraphHostPool", "GraphSynchronizer"]

#: whether torch can allocate pinned host memory while a stream is captured (its
#: caching host allocator, since 2.11 and its pre-releases: pytorch#167507); before,
#: a capture that allocates one fails inside CUDA, so the pool says what to do instead
PINNED_IN_CAPTURE = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 11)


class CaptureBackend:
    """A device backend as it is, but for waits outside a capture on events recorded in
    one, which are not made (NOTE [A captured step]); every other call is the device
    backend's."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.wrapped = backend
        self.captured_events: weakref.WeakSet[Any] = weakref.WeakSet()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def record_event(self, stream: Stream | None = None) -> Event:
        event = self.wrapped.record_event(stream)
        if self.wrapped.is_capturing():
            self.captured_events.add(event)
        return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        if event in self.captured_events and not self.wrapped.is_capturing():
            return  # a graph's node: nothing outside the graph can wait for it
        self.wrapped.wait_event(stream, event)

    def __repr__(self) -> str:
        return f"CaptureBackend({self.wrapped!r})"


class GraphHostPool(HostBufferPool):
    """The host pool of a context under CUDA graphs: each layer keeps its buffers
    (``retain``), and keeps them: a captured graph copies into them at every replay, so
    once a step was captured :meth:`empty_cache` refuses to free them (freed pinned
    blocks go back to torch's cache, which hands them to others), and the sets a
    capture took are the graph's alone: an eager pass (warm-up, a step between
    replays) gets sets of its own, which a replay cannot overwrite while it waits for
    its backward."""

    #: a step was captured: a graph may copy into the buffers at any replay
    captured = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the buffer sets a capture copies into, by id: a replay writes them while an
        #: eager pass in flight would hold its own offloaded data there
        self._graphs_own: dict[int, list[torch.Tensor | None]] = {}

    fixed = (
        "cuda_graph= keeps each offloaded layer's pinned host buffers at fixed addresses "
        "(a captured graph copies into them at every replay)",
        "Keep shapes fixed between steps, as a CUDA graph replays one shape (pad to one "
        "sequence length, drop the last partial batch: DataLoader(drop_last=True)); steps "
        "of another shape need an offload context of their own.",
    )

    def _acquire(
        self,
        layer_index: int,
        tensors: list[torch.Tensor],
        sizes: list[int] | None,
        layouts: Any,
    ) -> list[torch.Tensor | None]:
        backend = self._backend
        capturing = backend.is_capturing()
        if (
            not PINNED_IN_CAPTURE
            and not self._retained[layer_index]
            and backend.pin_memory
            and capturing
        ):
            raise CpuOffloadError(
                f"cpu_offload: cuda_graph=: layer {layer_index} needs new pinned host "
                f"buffers while its stream is captured, and torch {torch.__version__} "
                "cannot allocate pinned memory during a CUDA graph capture (torch 2.11 "
                "can: pytorch#167507). Run one eager step with the same shapes before "
                "the capture (it allocates every buffer the captured step needs), or "
                "upgrade torch to 2.11 or later."
            )
        buffers = super()._acquire(layer_index, tensors, sizes, layouts)
        if capturing:  # the graph's for its life: lent to no other pass
            self._graphs_own[id(buffers)] = buffers
        return buffers

    def _release(self, layer_index: int, buffers: list[torch.Tensor | None]) -> None:
        if id(buffers) not in self._graphs_own:  # a graph's are kept for its replays
            super()._release(layer_index, buffers)

    def empty_cache(self) -> None:
        if self.captured:
            raise CpuOffloadError(
                "cpu_offload: host_buffers.empty_cache() would free the pinned buffers that "
                "a captured CUDA graph copies into at every replay (cuda_graph=...), and "
                "torch would hand them to other tensors. Drop the graphs and the offload "
                "context together instead; their buffers go with the context."
            )
        super().empty_cache()


def capture_changed(layer: int, captured: bool) -> str:
    """The error of a ``"step"`` pass whose layers are not all in one capture."""
    began, now = ("inside", "outside") if captured else ("outside", "inside")
    return (
        f"cpu_offload: cuda_graph=True captures a whole step in one CUDA graph, but layer "
        f"{layer} of this forward pass entered the offload context {now} a capture, and "
        f"the pass began {began} one: its copies would cross the capture's boundary. "
        "For per-layer graphs (make_graphed_callables, Megatron's per-layer graphs) "
        "pass cuda_graph='layer'; for one graph per step, run every layer's forward "
        "and backward inside the torch.cuda.graph block."
    )


#: a step whose offloaded layers saved nothing inside the context, before any capture
GRAPHED_OUTSIDE = (
    "cpu_offload: cuda_graph= is set, but the offloaded layers saved nothing for backward "
    "inside the offload context, and no CUDA graph capture has run inside it. Layers "
    "graphed with the context entered around the graphed call (as Megatron's blocks enter "
    "it around each layer) run as replays that the context cannot see: nothing is "
    "offloaded. Enter the offload context inside each graphed callable, so that the "
    "capture records its copies (docs/cuda_graphs.md, per-layer graphs). This warning is "
    "shown once."
)


def saved_nothing(record: StepRecord) -> bool:
    """Whether no layer of the step saved a tensor (its forwards were graph replays)."""
    for source in record.layers:
        if source is None:
            continue
        counts = source.save_counts()
        if counts.kept_fast or counts.kept or counts.moved or counts.capped:
            return False
        if counts.not_copied:
            return False
    return True


class GraphSynchronizer(DefaultOffloadSynchronizer):
    """:class:`DefaultOffloadSynchronizer` inside CUDA graphs (NOTE [A captured step]).

    Args:
        scope: ``"step"`` (one graph per step) or ``"layer"`` (one per layer's forward
            and backward); NOTE [Graph shapes] in graph_options.py.
        args, kwargs: as for :class:`DefaultOffloadSynchronizer`.
    """

    def __init__(self, *args: Any, scope: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cuda_graph = scope
        pool = self.host_buffers  # fixed addresses, per layer, for the graphs' life
        self.host_buffers = GraphHostPool(self.backend, True, pool.max_bytes, self.stats)
        self.backend = cast(DeviceBackend, CaptureBackend(self.backend))
        self.graph_steps = GraphSteps()
        self._captured: weakref.WeakSet[ForwardPass] = weakref.WeakSet()
        self._last_captured = False  # the last published step was captured
        self._eager_since_capture = False
        self._captured_pass: int | None = None  # the index of the pass captured last
        self._captured_allocations = 0  # its host allocations so far
        self._warned_outside = False  # GRAPHED_OUTSIDE said

    def describe(self) -> str:
        return f"{super().describe()}; cuda_graph={self.cuda_graph!r}"

    # --------------------------------------------------------- forward

    def forward_step(self) -> tuple[int, ForwardPass]:
        capturing = self.backend.is_capturing()
        if not capturing and self.graph_steps.captures and torch.is_grad_enabled():
            self._eager_since_capture = True  # (until its step turns out a replay)
        layer, forward_pass = super().forward_step()
        if capturing:
            self._captured.add(forward_pass)
        return layer, forward_pass

    def _on_forward(self, forward_pass: ForwardPass, layer: int) -> None:
        if self.cuda_graph == "layer" and forward_pass in self._captured:
            return  # each layer offloads at its own end (fwd_end)
        captured = forward_pass in self._captured
        if layer and self.cuda_graph == "step" and captured != self.backend.is_capturing():
            raise CpuOffloadError(capture_changed(layer, captured))
        super()._on_forward(forward_pass, layer)

    def fwd_end(self) -> None:
        current = self.current_pass
        if self.cuda_graph == "layer" and current is not None and current in self._captured:
            layer = current.layers_forwarded - 1
            if layer in self._offloaded and self.backend.is_capturing():
                state = current.state(layer)
                state.start_offload()  # forks the copy stream from the capturing one
                state.release_activation_forward_gpu_memory()  # and joins it
        super().fwd_end()

    # -------------------------------------------------------- backward

    def _on_backward(self, forward_pass: ForwardPass, layer: int) -> None:
        if self.cuda_graph == "layer" and self.backend.is_capturing():
            if layer in self._offloaded:  # its own reload, in its own graph
                state = forward_pass.state(layer)
                if state.state is LayerState.OFFLOAD_FINISHED:
                    state.start_reload()
            return
        super()._on_backward(forward_pass, layer)

    # ------------------------------------------------------------ steps

    def end_step(self, record: StepRecord) -> None:
        steps = self.graph_steps
        if self.backend.is_capturing():
            again = record.forward_pass == self._captured_pass  # "layer": one per layer
            steps.captures += not again
            self._captured_pass = record.forward_pass
            self._last_captured, self._eager_since_capture = True, False
            cast(GraphHostPool, self.host_buffers).captured = True
            super().end_step(record)
            if again:  # the pass's host allocations since its first captured backward
                record.host_allocations += self._captured_allocations
            self._captured_allocations = record.host_allocations
            return
        nothing = saved_nothing(record)
        if steps.captures and nothing:
            self._eager_since_capture = False  # a forward through graphed layers: a replay
            return
        if nothing and not self._warned_outside:
            self._warned_outside = True  # graphs captured outside the context, or no saves
            warn(GRAPHED_OUTSIDE)
        steps.warmup_steps += not steps.captures
        self._last_captured = False
        super().end_step(record)

    def report(self, policy: Sequence[str] | None = None) -> StepReport:
        """The last step the hooks saw, with what graphs did (NOTE [What a replay
        reports] in report/graph_report.py)."""
        steps = self.graph_steps
        replay = self._last_captured and not self._eager_since_capture
        said = GraphSteps(self._last_captured, replay, steps.warmup_steps, steps.captures)
        return GraphStepReport.of(super().report(policy), said)
