"""The engine of a whole-forward context (``chunked.py``): its forwards and their chunks.

A :class:`ChunkEngine` is an :class:`~cpu_offload.engine.offload_engine.OffloadEngine` whose layer states
are the chunks of forwards (:class:`ChunkedForward`); it keeps the forwards whose graphs
are alive, weakly, and reports a forward as a step when its graph has gone (NOTE [What a
step is] in step_report.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from ..report.step_record import StepRecord
from ..report.step_report import StepReport
from .layer_state import OffloadableLayerState
from .offload_engine import OffloadEngine

__all__ = ["ChunkEngine", "ChunkedForward"]


class ChunkedForward:
    """One forward run under a ``ChunkedOffload``: its chunks, held weakly (the
    graph owns the chunks, and each chunk holds its forward as ``owner``)."""

    __slots__ = ("index", "_chunks", "record", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index
        self._chunks: list[weakref.ref[OffloadableLayerState]] = []
        #: the forward as a step, each chunk's counts in it (they outlive the chunks)
        self.record = StepRecord(index, [])

    @property
    def chunks(self) -> list[OffloadableLayerState]:
        """The chunks whose saved tensors autograd may still unpack."""
        return [chunk for ref in self._chunks if (chunk := ref()) is not None]

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of this forward's data that sits in host memory now."""
        return sum(chunk.get_offloaded_total_size_mb() for chunk in self.chunks)

    def __repr__(self) -> str:
        return f"ChunkedForward(index={self.index}, chunks={len(self._chunks)})"


class ChunkEngine(OffloadEngine):
    """The engine of a ``ChunkedOffload``: stream, host buffer pool, statistics,
    and the forwards whose graphs are alive."""

    reload_advice = None  # a chunk backward reaches out of order reloads silently

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forwards: list[weakref.ref[ChunkedForward]] = []
        self._lock = threading.Lock()
        #: warn (once) when a forward moved nothing
        self.warn_if_nothing_moved = True

    def new_forward(self) -> ChunkedForward:
        with self._lock:
            forward = ChunkedForward(self.stats.forward_passes)
            self.stats.forward_passes += 1
            self._forwards = [ref for ref in self._forwards if ref() is not None]
            self._forwards.append(weakref.ref(forward))
        return forward

    def new_chunk(self, forward: ChunkedForward) -> OffloadableLayerState:
        """The next chunk of ``forward``."""
        number = len(forward._chunks)
        chunk = self.new_layer_state(number, f"chunk {number} of forward pass {forward.index}")
        chunk.owner = forward
        forward._chunks.append(weakref.ref(chunk))
        forward.record.layers.append(chunk.saves)
        return chunk

    def end_forward(self, forward: ChunkedForward) -> None:
        """``forward`` has ended: measure memory now, and report it as a step when its
        graph goes (after its backward has freed its saved tensors)."""
        forward.record.end_of_forward = self.measure_end_of_forward()
        weakref.finalize(forward, self._graph_gone, forward.record).atexit = False

    def _graph_gone(self, record: StepRecord) -> None:
        """A forward's graph has gone: it was a step if a backward ran through it (a
        forward whose graph was dropped, evaluation with grad on, replaces nothing)."""
        if record.backward_ran:
            self.end_step(record)

    def report(self, policy: Sequence[str] | None = None) -> StepReport:
        """What the last completed step did, per chunk (NOTE [What a step is] in
        step_report.py: here a step ends when its backward has freed the forward's
        saved tensors)."""
        return self.recorder.report(str(self.backend.device), "chunk")

    def in_flight_passes(self) -> list[ChunkedForward]:
        """Forwards whose graphs are alive (some chunk's saved tensors may still be
        unpacked), oldest first."""
        return [forward for ref in self._forwards if (forward := ref()) is not None]

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of offloaded data in host memory now, over all forwards in flight."""
        return sum(forward.get_offloaded_total_size_mb() for forward in self.in_flight_passes())
