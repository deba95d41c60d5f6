"""The default schedule inside CUDA graphs: a captured step whose replays repeat its copies.

NOTE [A captured step]
    Capture records what the streams are given and runs nothing; a replay re-issues the
    record without Python.  So, with ``cuda_graph`` (NOTE [Graph shapes] in
    graph_options.py):

    * Host buffers are fixed: each layer keeps its pinned buffers for the next passes
      (the pool's ``retain`` mode), allocated in the eager warm-up steps before the
      capture (or during it where the device allows), never lent to another layer
      while a graph that copies into them may replay.
    * Device buffers of a reload are allocated on the capturing stream, from the
      graph's pool, and handed to no other stream (:class:`CaptureBackend` ignores
      ``record_stream`` while capturing; backward runs on the capturing stream).
    * The copy stream forks from the capturing stream (it waits for an event recorded
      there before each copy, as in eager) and joins it, as in eager: the capturing
      stream waits for a layer's offload before its device memory is released, for its
      reload at its first unpack, and for every copy in flight when backward releases
      the layer.  In ``"layer"`` graphs a layer's offload is released at the end of its
      own forward and its reload issued as its own backward starts, so both are joined
      in the layer's graphs; in ``"step"`` graphs, by the end of the step's backward.
    * Nothing but the captured work decides per step: no host synchronisation, no
      allocation after the warm-up, the schedule fixed by the layer indices.

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

from ..device.backend import DeviceBackend, Stream
from ..engine.forward_pass import ForwardPass
from ..engine.host_buffers import HostBufferPool
from ..engine.synchronizer import DefaultOffloadSynchronizer
from ..engine.transitions import LayerState
from ..errors import CpuOffloadError
from ..report.graph_report import GraphStepReport, GraphSteps
from ..report.step_record import StepRecord
from ..report.step_report import StepReport

__all__ = ["CaptureBackend", "GraphHostPool", "GraphSynchronizer"]


class CaptureBackend:
    """A device backend as it is, but for ``record_stream``, which does nothing while the
    current stream is captured (NOTE [A captured step]); every other call is the
    device backend's."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.wrapped = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def record_stream(self, tensor: Any, stream: Stream) -> None:
        if not self.wrapped.is_capturing():
            self.wrapped.record_stream(tensor, stream)

    def __repr__(self) -> str:
        return f"CaptureBackend({self.wrapped!r})"


class GraphHostPool(HostBufferPool):
    """The host pool of a context under CUDA graphs: each layer keeps its buffers
    (``retain``), and keeps them: a captured graph copies into them at every replay, so
    once a step was captured :meth:`empty_cache` refuses to free them (freed pinned
    blocks go back to torch's cache, which hands them to others)."""

    #: a step was captured: a graph may copy into the buffers at any replay
    captured = False

    def empty_cache(self) -> None:
        if self.captured:
            raise CpuOffloadError(
                "cpu_offload: host_buffers.empty_cache() would free the pinned buffers that "
                "a captured CUDA graph copies into at every replay (cuda_graph=...), and "
                "torch would hand them to other tensors. Drop the graphs and the offload "
                "context together instead; their buffers go with the context."
            )
        super().empty_cache()


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
        if steps.captures and saved_nothing(record):
            self._eager_since_capture = False  # a forward through graphed layers: a replay
            return
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
