"""The state machine of a layer's saved tensors: its states, its transitions in one
table, and the base class that takes them.

:class:`LayerTransitions` holds a layer's current push cycle (a
:class:`~cpu_offload.engine.layer_data.LayerData`, made at its first push of a tensor to copy)
and takes the guarded transitions a synchronizer calls: start the offload, release the
forward memory, start the reload, release everything after backward.  It also owns the
cycle's lifetime: the lease's finalizer drops the data when the graph no longer holds
any handle (NOTE [Lifetime of a layer's data] in handles.py).  What the hooks call, push
and pop, is :class:`~cpu_offload.engine.layer_state.OffloadableLayerState`.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..device.backend import DeviceBackend
from ..errors import OffloadStateError
from ..hooks.handles import Lease
from ..report.copy_timer import CopyTimer
from ..report.profiler_ranges import in_range
from ..report.stats import OffloadStats
from ..report.step_record import SaveCounts
from .host_buffers import HostBufferPool
from .layer_data import LayerData, count_moves, pushed_bytes
from .reload_slices import SlicedReload

__all__ = ["TRANSITIONS", "LayerState", "LayerTransitions", "Transition"]


class LayerState(enum.Enum):
    """Where the saved tensors of one layer are."""

    NOT_OFFLOADED = "not_offloaded"
    OFFLOAD_STARTED = "offload_started"
    OFFLOAD_FINISHED = "offload_finished"
    RELOAD_STARTED = "reload_started"


@dataclass(frozen=True)
class Transition:
    """One guarded operation of the state machine."""

    needs: LayerState
    leads_to: LayerState
    advice: str  # the likely fix, shown when the state is not ``needs``


#: The state machine in one place: per operation, the state it needs, the state it
#: leads to, and the advice when it is called in another state.  ``release_all_memory``
#: is allowed from every state (to NOT_OFFLOADED, or OFFLOAD_FINISHED while the graph
#: may still unpack the layer).
TRANSITIONS = {
    "push_tensor": Transition(
        LayerState.NOT_OFFLOADED,
        LayerState.NOT_OFFLOADED,
        "Tensors can be saved for a layer only before its offload starts; start the "
        "offload after the layer's forward has finished.",
    ),
    "start_offload": Transition(
        LayerState.NOT_OFFLOADED,
        LayerState.OFFLOAD_STARTED,
        "Call start_offload_layer once per layer and forward pass.",
    ),
    "release_activation_forward_gpu_memory": Transition(
        LayerState.OFFLOAD_STARTED,
        LayerState.OFFLOAD_FINISHED,
        "Call start_offload_layer(i) before release_activation_forward_gpu_memory(i), "
        "and only once.",
    ),
    "start_reload": Transition(
        LayerState.OFFLOAD_FINISHED,
        LayerState.RELOAD_STARTED,
        "Call start_reload_layer(i) once, after release_activation_forward_gpu_memory(i).",
    ),
}

_NOT_OFFLOADED = LayerState.NOT_OFFLOADED
_OFFLOAD_FINISHED = LayerState.OFFLOAD_FINISHED
_RELOAD_STARTED = LayerState.RELOAD_STARTED


class LayerTransitions:
    """A layer's push cycle and the guarded transitions of its state; see the module.

    Attributes:
        state: the :class:`LayerState`.
        generation: counts push cycles (a finalizer of an older one does nothing).
        kept_fast: per tensor the cycle kept under the threshold its bytes, per
            parameter ``~bytes`` (NOTE [Counting saved tensors for nearly nothing] in
            step_record.py); :attr:`saves` holds it with the other counts.
        layer_index, name, backend, offload_stream, host_buffers, stats, copy_timer:
            what the copies use (set by the subclass).
    """

    layer_index: int
    name: str
    backend: DeviceBackend
    offload_stream: Any
    host_buffers: HostBufferPool
    stats: OffloadStats
    copy_timer: CopyTimer | None

    def __init__(self) -> None:
        self.state = _NOT_OFFLOADED
        self.generation = 0
        #: the current push cycle's data: made by its first push of a tensor to copy
        #: (most layer states never have one), gone with its lease
        self._data: LayerData | None = None
        self._held_lease: Lease | None = None  # strong: tensors pushed by hand
        self._backward_done = False  # the cycle's backward released the layer
        self.kept_fast: list[int] = []
        self._saves: SaveCounts | None = None  # made when something else is counted
        #: bytes per slice of a reload in slices (None: whole; NOTE [Reloading a layer in
        #: slices] in reload_slices.py), and the slices of the reload under way
        self.reload_slice_bytes: int | None = None
        self.slices: SlicedReload | None = None
        #: False: the slices come back on demand (NOTE [Slices at the peak])
        self.reload_prefetch = True

    def _transition(self, operation: str) -> None:
        """Check ``operation`` against :data:`TRANSITIONS` and take it."""
        transition = TRANSITIONS[operation]
        if self.state is not transition.needs:
            raise OffloadStateError(
                f"cpu_offload: cannot {operation} for {self.name}: its state is "
                f"{self.state.name}, but {operation} needs {transition.needs.name}. "
                f"{transition.advice}"
            )
        self.state = transition.leads_to

    # ------------------------------------------------------------- push / pop

    # Pack and unpack hooks run eagerly (NOTE [Hooks around compiled code] in eager.py).
    # This is the cost of every saved tensor: checks are ordered by how often they decide.
    def start_offload(self) -> None:
        """Queue device-to-host copies of the layer's tensors on the offload stream."""
        self._transition("start_offload")
        data = self._data
        if data is not None:
            data.aliases = {}  # no more pushes: only the lists hold the tensors now
            if data.pushed:
                in_range("offload", self.name, data.copy_out, self)
                count_moves(data, self.saves)

    def release_activation_forward_gpu_memory(self) -> None:
        """Drop the device copies once the offload has read them."""
        self._transition("release_activation_forward_gpu_memory")
        data = self._data
        if data is not None:
            in_range("release", self.name, self._release_forward, data)

    def _release_forward(self, data: LayerData) -> None:
        data.wait_for_copies(self)
        data.drop_pushed()
        data.unique = []
        self.saves.released_bytes += data.host_bytes

    def start_reload(self) -> None:
        """Queue host-to-device copies on the offload stream, one event for the layer
        (or its first slice: NOTE [Reloading a layer in slices] in reload_slices.py)."""
        self._transition("start_reload")
        data = self._data
        if data is not None:
            slice_bytes = self.reload_slice_bytes
            if slice_bytes is None or not data.host or data.host_bytes <= slice_bytes:
                self.slices = None
                in_range("reload", self.name, data.copy_in, self)
                self.saves.reloaded_bytes += data.host_bytes
            else:  # each slice's bytes counted as its copies are issued
                self.slices = SlicedReload.start(
                    data, self, slice_bytes, self.saves, self.reload_prefetch
                )

    def release_all_memory(self) -> None:
        """Drop the layer's device tensors after its backward.

        Allowed in every state.  While the graph may still unpack the layer's tensors
        (``retain_graph=True``), offloaded data stays on the host and the layer goes to
        ``OFFLOAD_FINISHED``, from where a second backward reloads it; tensors that were
        never copied stay on the device.  Otherwise everything goes and the layer is
        back to ``NOT_OFFLOADED``.
        """
        self._held_lease = None  # what was pushed by hand lives as long as its handles now
        data = self._data
        if data is None or data.lease() is None:
            self._drop_data()
            self.state = _NOT_OFFLOADED
            return
        if self.state is _NOT_OFFLOADED:
            return  # never copied: the device tensors live as long as the graph
        in_range("release_all", self.name, self._release_after_backward, data)
        self._backward_done = True
        self.state = _OFFLOAD_FINISHED

    def _release_after_backward(self, data: LayerData) -> None:
        data.wait_for_copies(self)
        data.drop_pushed()
        data.reloaded, data.unique = [], []
        self.slices = None

    def join_copies(self) -> None:
        """The compute stream waits for the layer's copies in flight (a captured graph's
        end: NOTE [Graph shapes] in graphs/graph_options.py)."""
        data = self._data
        if data is not None:
            data.wait_for_copies(self)

    def _new_cycle(self, lease: Lease) -> LayerData:
        """The first push of a tensor to copy in this cycle: its data, which goes when
        ``lease`` does (the handles hold it)."""
        data = self._data = LayerData(lease)
        weakref.finalize(lease, self._graph_released, self.generation).atexit = False
        return data

    def _start_new_cycle(self) -> None:
        """A state reused for a new forward after its backward: the old graph's
        handles lose their data (popping one raises)."""
        self._held_lease = None
        self._drop_data()
        self.kept_fast, self._saves = [], None
        self.generation += 1
        self.state = _NOT_OFFLOADED

    def _graph_released(self, generation: int) -> None:
        """Finalizer of the lease: no handle of this push cycle is left."""
        if generation != self.generation:
            return  # the state was reused since; that cycle's data is gone already
        after_backward = self._backward_done or self.state is _RELOAD_STARTED
        self._drop_data()
        self.generation += 1
        if after_backward:
            self.state = _NOT_OFFLOADED

    def _drop_data(self) -> None:
        data, self._data = self._data, None
        self._backward_done = False
        self.slices = None
        if data is not None:
            if not data.host and data.pushed:  # pushed to move, never copied
                self.saves.not_copied += len(data.pushed)
                self.saves.not_copied_bytes += pushed_bytes(data)
            in_range("release_all", self.name, data.release, self)

    def add_shared_pop(self, lease: Lease, position: int) -> None:
        """A shared handle will pop ``position`` of ``lease``'s cycle as well (NOTE
        [Reloaded tensors go one by one] in layer_data.py)."""
        data = self._data
        if data is not None and data.lease() is lease:
            shares = data.shares
            if shares is None:
                shares = data.shares = {}
            shares[position] = shares.get(position, 0) + 1

    # -------------------------------------------------------------- queries

    @property
    def saves(self) -> SaveCounts:
        """What the cycle did with its saved tensors (the step report's counts)."""
        saves = self._saves
        if saves is None:
            saves = self._saves = SaveCounts(self.kept_fast)
        return saves

    def save_counts(self) -> SaveCounts:
        """What the cycle did with its saved tensors, those pushed to move and not
        copied (yet) included."""
        data = self._data
        if data is None or data.host or not data.pushed:
            return self.saves
        return self.saves.with_not_copied(len(data.pushed), pushed_bytes(data))

    @property
    def backward_done(self) -> bool:
        """Whether a backward released the layer while its graph may still unpack it
        (``retain_graph=True``: the host copy stays for a second backward)."""
        return self._backward_done

    def holds_data(self) -> bool:
        """Whether a push cycle's data is alive: handles autograd may still unpack, or
        tensors pushed by hand."""
        data = self._data
        return self._held_lease is not None or (data is not None and data.lease() is not None)

    def went_to_host(self, lease: Lease, position: int) -> bool:
        """Whether the tensor pushed at ``position`` of ``lease``'s cycle has a host copy."""
        data = self._data
        return data is not None and data.lease() is lease and data.went_to_host(position)

    def holds_storage(self, cdata: int) -> bool:
        """Whether a tensor pushed to be offloaded, not yet copied, lives in the storage
        ``cdata`` (a ``StorageWeakRef``'s)."""
        data = self._data
        return data is not None and any(t.untyped_storage()._cdata == cdata for t in data.pushed)

    def pending_copies(self) -> list[torch.Tensor]:
        """The device tensors a :meth:`start_offload` now would copy (one per distinct
        tensor, after group processing): what the layer would move."""
        data = self._data
        return [] if data is None or self.state is not _NOT_OFFLOADED else data.to_copy()[0]

    @property
    def num_offloaded_tensors(self) -> int:
        """Distinct tensors copied (or to be copied) to the host."""
        data = self._data
        return 0 if data is None else sum(h is not None for h in data.host)

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of this layer's data that sits in host memory now."""
        if self.state is _NOT_OFFLOADED or self._data is None:
            return 0.0
        return self._data.host_bytes / 2**20
