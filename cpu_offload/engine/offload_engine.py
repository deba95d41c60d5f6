"""What the layer states of one offload context share, and the states it makes.

An :class:`OffloadEngine` holds the device backend, the offload stream, the host buffer
pool, the thresholds that decide which saved tensors move, the statistics and the copy
timer, and makes the layer states that use them (:meth:`OffloadEngine.new_layer_state`).
Two kinds of context build on it: the synchronizers (``synchronizer.py``: forward passes
of numbered layers, on a schedule) and the whole-forward context (``chunked.py``: chunks
of one forward cut by bytes).

The whole-forward context's engine is here too: a :class:`ChunkEngine` is an
:class:`OffloadEngine` whose layer states are the chunks of forwards
(:class:`ChunkedForward`); it keeps the forwards whose graphs are alive, weakly, and
reports a forward as a step when its graph has gone (NOTE [What a step is] in
step_report.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..device.amounts import integer
from ..device.backend import DeviceBackend, Stream
from ..device.host_cap import host_cap_bytes
from ..device.runtime import get_backend
from ..hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL
from ..report.copy_timer import CopyTimer
from ..report.policy_words import describe_policy, pass_policy_words
from ..report.stats import OffloadStats
from ..report.step_record import Measured, StepRecord
from ..report.step_report import StepRecorder, StepReport
from .host_buffers import HostBufferPool
from .layer_state import OffloadableLayerState

__all__ = ["ChunkEngine", "ChunkedForward", "OffloadEngine", "check_count"]


def said_host_cap(given: object, host_cap: int | None) -> str:
    """``max_host_bytes`` as reprs say it: ``max_host_bytes=None``, or the cap in bytes
    (``host_cap_bytes=...``) after what was given where that was a string."""
    if host_cap is None:
        return "max_host_bytes=None"
    if isinstance(given, str):
        return f"max_host_bytes={given!r}, host_cap_bytes={host_cap}"
    return f"max_host_bytes={host_cap}, host_cap_bytes={host_cap}"


def check_count(name: str, value: object, expected: str) -> None:
    """``value`` is a count (of bytes, of elements): an int >= 0, not a bool
    (TypeError, else ValueError)."""
    whole = integer(value)
    if whole is None:
        raise TypeError(f"cpu_offload: {name} must be {expected}, got {value!r}.")
    if whole < 0:
        raise ValueError(f"cpu_offload: {name} must be {expected}, got {value!r}.")


class OffloadEngine:
    """The resources of one offload context; see the module.

    Args:
        retain_pinned_cpu_buffers: keep host buffers for the next iteration.
        offload_stream: stream for all copies; a new one by default.
        device: device whose tensors are offloaded; the best available by default.
        min_offload_numel: smaller saved tensors stay on the device.
        min_offload_bytes: so do saved tensors of fewer bytes.
        max_host_bytes: the most host memory the buffer pool may hold; a tensor that
            does not fit stays on the device (``stats.tensors_kept_by_host_cap``).

    Attributes:
        backend: the device backend.
        stats: what the context's layer states moved (:class:`OffloadStats`), running totals.
        recorder: the last completed step, for :meth:`report`.
        host_buffers: the host buffer pool.
        copy_timer: set by benchmarks to time the copies.
    """

    #: layers per forward pass, and which of them a schedule offloads (None: a manual
    #: controller decides); set by the synchronizers, named in reports
    model_layers = 0
    offloaded_layers: list[int] | None = None
    #: the passes in flight that keep the schedule, the others moved whole (None: all)
    keep_passes: int | None = None
    #: the CUDA graph shape the context runs in (``"step"``, ``"layer"``; NOTE [Graph
    #: shapes] in graphs/graph_options.py), None: eager only, a capture is refused
    cuda_graph: str | None = None

    #: what a layer reloaded on demand in its first backward tells the user to do (None:
    #: such a reload is expected, and silent)
    reload_advice: str | None = "Call the sync function on every layer's output to prefetch it."
    #: the same, for the layers ``offload_layers`` hooks (its hooks call the sync function)
    hooked_reload_advice = (
        "offload_layers starts a layer's reload when backward reaches the output of a later "
        "layer, and backward reached this one first: a later layer's output does not lead "
        "to the loss (a branch, an early exit), or the layers ran in another order than "
        "they are listed. Keep the layer (policy=) to spare the wait."
    )
    #: the class of the layer states it makes
    layer_state_class: type[OffloadableLayerState] = OffloadableLayerState

    def __init__(
        self,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: Any = None,
        *,
        device: torch.device | str | None = None,
        min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL,
        min_offload_bytes: int = 0,
        max_host_bytes: int | str | None = None,
    ) -> None:
        check_count("min_offload_bytes", min_offload_bytes, "an int >= 0")
        host_cap = host_cap_bytes(max_host_bytes)
        if offload_stream is not None and not isinstance(offload_stream, Stream):
            raise TypeError(
                "cpu_offload: offload_stream must be a stream of the device (such as "
                f"torch.cuda.Stream()), got {type(offload_stream).__name__} {offload_stream!r}. "
                "Pass None to let the offloader create one."
            )
        if integer(min_offload_numel) is None or min_offload_numel < 0:
            raise ValueError(
                f"cpu_offload: min_offload_numel must be an int >= 0, got {min_offload_numel!r}."
            )
        self.backend: DeviceBackend = get_backend(device)
        self._offload_stream = offload_stream  # created at first use (see below)
        self.stats = OffloadStats()
        self.recorder = StepRecorder()
        self.host_buffers = HostBufferPool(
            self.backend, retain_pinned_cpu_buffers, host_cap, self.stats
        )
        #: ``max_host_bytes`` as given (``"auto"``, ``"64GiB"``), for reprs
        self.max_host_bytes = max_host_bytes
        self.min_offload_numel = min_offload_numel
        self.min_offload_bytes = min_offload_bytes
        self.copy_timer: CopyTimer | None = None
        #: NOTE [Reloading a layer in slices] in reload_slices.py (None: whole layers)
        self.reload_slice_bytes: int | None = None
        #: layers whose slices come back on demand (NOTE [Slices at the peak])
        self.reload_on_demand_layers: frozenset[int] = frozenset()
        self._allocations_before_step = 0  # the pool's allocations when the last step ended

    @property
    def offload_stream(self) -> Any:
        """The stream of all copies; created when first needed, so that it lives on
        the device that is current then (after ``set_device(local_rank)``)."""
        if self._offload_stream is None:
            self._offload_stream = self.backend.new_stream()
        return self._offload_stream

    def new_layer_state(self, index: int, name: str) -> OffloadableLayerState:
        """A layer state that copies on this engine's stream into its pool, by its
        thresholds, counted in its statistics."""
        state = self.layer_state_class(
            self.offload_stream,
            layer_index=index,
            backend=self.backend,
            host_buffers=self.host_buffers,
            min_offload_numel=self.min_offload_numel,
            min_offload_bytes=self.min_offload_bytes,
            stats=self.stats,
            name=name,
            copy_timer=self.copy_timer,
        )
        state.reload_advice = self.reload_advice
        state.reload_slice_bytes = self.reload_slice_bytes
        state.reload_prefetch = index not in self.reload_on_demand_layers
        return state

    def host_memory_stats(self) -> dict[str, int]:
        """Host memory held for offloaded tensors (see :meth:`HostBufferPool.stats`).

        ``reserved_bytes`` (held, in use or cached), ``in_use_bytes``,
        ``requested_bytes``, ``peak_requested_bytes``, ``num_host_alloc`` and
        ``num_host_free``.  ``host_buffers.empty_cache()`` frees the cached part.
        """
        return self.host_buffers.stats()

    # ------------------------------------------------------------ reports

    def thresholds(self, bytes_name: str = "min_offload_bytes") -> str:
        """The thresholds that decide which saved tensors move, as reprs say them."""
        cap = said_host_cap(self.max_host_bytes, self.host_buffers.max_bytes)
        return (
            f"min_offload_numel={self.min_offload_numel}, {bytes_name}="
            f"{self.min_offload_bytes}, {cap}"
        )

    def describe(self) -> str:
        """The layers, the schedule and the thresholds, as the contexts' reprs say them."""
        offloaded = self.offloaded_layers
        if offloaded is None:
            schedule = "a manual controller offloads"
        else:  # in the words of offload_layers' handle: "layers 0-1 offload, 2-3 keep"
            chosen = set(offloaded)
            policy = ["offload" if i in chosen else "keep" for i in range(self.model_layers)]
            schedule = f"layers {describe_policy(policy)} (k={len(offloaded)})"
            if self.keep_passes is not None:
                schedule += f"; {pass_policy_words(self.keep_passes)}"
        return (
            f"{self.model_layers} layers per forward pass, {schedule}; {self.thresholds()}; "
            f"device {self.backend.device}"
        )

    def measure_end_of_forward(self) -> Measured:
        """Host and device memory now, at the end of a forward pass (for its report)."""
        return (*self.host_buffers.usage(), self.backend.memory_allocated())

    def end_step(self, record: StepRecord) -> None:
        """A step has ended (NOTE [What a step is] in step_report.py)."""
        record.device_peak_bytes = self.backend.max_memory_allocated()
        allocations = self.host_buffers.allocations
        record.host_allocations = allocations - self._allocations_before_step
        self._allocations_before_step = allocations
        record.host_cap_bytes = self.host_buffers.max_bytes
        self.recorder.publish(record)

    def report(self, policy: Sequence[str] | None = None) -> StepReport:
        """What the last completed step did (NOTE [What a step is] in step_report.py).

        Per layer: the tensors its forward saved, moved to the host and kept on the
        device, with why each kept tensor stayed; the host pool's memory and the
        device's at the end of the forward.  ``print()`` it for a table, ``to_dict()``
        for loggers.

        Args:
            policy: what each layer is (``offload_layers``' policy); by default
                ``offload`` where the schedule offloads, else ``keep`` (``manual``
                under a manual controller).
        """
        layers = self.model_layers
        policy = self.recorder.last_choices() or policy
        if policy is None:
            offloaded = self.offloaded_layers
            policy = [
                "manual" if offloaded is None else ("offload" if i in offloaded else "keep")
                for i in range(layers)
            ]
        notes = {
            i: "the last layer: never offloaded" if i == layers - 1 else "not offloaded"
            for i, choice in enumerate(policy)
            if choice in ("keep", "checkpoint", "measured")
        }
        checkpointed = [i for i, choice in enumerate(policy) if choice.startswith("checkpoint")]
        return self.recorder.report(str(self.backend.device), "layer", policy, notes, checkpointed)


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
