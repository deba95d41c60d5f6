"""The per-layer state machine: the mechanism that copies a layer's saved tensors.

A layer state only knows how to push, offload, release, reload and pop; when to do
each is decided by a synchronizer (``synchronizer.py``).  It decides which saved
tensors move (``selection.py``), hands back what the pack hook returns (``handles.py``)
and takes the state machine's transitions; the data of its current push cycle, and the
copies themselves, are a :class:`~cpu_offload.layer_data.LayerData` (NOTE [Offload
stream ordering] there).

NOTE [Saved tensors without their history]
    A layer holds the device tensors it was handed as aliases without autograd
    history (``detach()``: same memory, same version counter).  The tensor the pack
    hook receives carries its ``grad_fn``, and that node may hold this layer (through
    the handles it saved) or its forward pass (through the pre-hook ``sync_fn``
    registered): holding the tensor itself would close a cycle through C++ autograd
    nodes that Python's garbage collector cannot see, and a graph dropped without a
    backward (an exception mid-forward) would never be freed.  Ownership runs one
    way: the graph owns the handles, the handles the layer, the layer plain memory.
    One alias is made per tensor object, so a tensor saved twice is still copied
    once, and a view that moves through its base becomes a view of its base's alias.

NOTE [Version counter checks]
    With saved-tensor hooks autograd no longer compares a saved tensor's version
    counter at unpack.  The layer state does it instead, for every tensor it hands
    back, whether or not the user's tensor object is still alive: the version is
    recorded at push and compared at unpack with the counter of the layer's own alias
    (which shares the original's counter, as every view and ``detach()`` of it does).
    When the layer drops its device tensors (release), each alias is replaced by a
    *version keeper*: a tensor that shares the counter and holds no memory, so an
    in-place change made afterwards through any surviving view or alias is still
    seen.  A tensor modified before its copy starts is still copied, ordered after
    the modifying work (its unpack raises); one modified while its copy runs gives a
    torn host copy that is never handed back.
    Tensors the layer keeps on the device carry their version in their handle for the same
    check.  The error is autograd's, with the layer named.
"""

from __future__ import annotations

import enum
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn import Parameter

from .copy_timer import CopyTimer
from .device import DeviceBackend, get_backend
from .eager import eager
from .errors import OffloadStateError
from .handles import (
    Decomposed,
    Lease,
    describe,
    is_moved_handle,
    kept_handle,
    modified_error,
    unpack_saved,
    verbatim,
)
from .host_buffers import HostBufferPool
from .layer_data import LayerData
from .marks import marks_of
from .saving_protocol import decompose, has_saving_protocol
from .selection import DEFAULT_MIN_OFFLOAD_NUMEL, NOT_DENSE, plain_kept_because, warn_not_dense
from .stats import OffloadStats
from .tensor_group import offloads_through_base

__all__ = ["TRANSITIONS", "LayerState", "OffloadableLayerState", "Transition"]


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
_Tensor = torch.Tensor
_Parameter = Parameter


class OffloadableLayerState:
    """Saved tensors of one layer of one forward pass, and their copies.

    Constructed as TransformerEngine constructs its own,
    ``OffloadableLayerState(offload_stream=stream)``; everything else is optional.

    Args:
        offload_stream: stream on which copies run; a new one of the backend by default.
        retain_pinned_cpu_buffers: keep this layer's host buffers for the next
            iteration (used when no ``host_buffers`` pool is given).
        layer_index: index of the layer in the model (messages, host buffer reuse).
        backend: the device backend; the best available device's by default.
        host_buffers: pool that hands out host buffers; a new one by default.
        min_offload_numel: smaller tensors stay on the device.
        min_offload_bytes: so do tensors of fewer bytes.
        stats: counters to update.
        name: how messages name this layer.
        copy_timer: records timing events around the copies (benchmarks).
    """

    def __init__(
        self,
        offload_stream: Any = None,
        retain_pinned_cpu_buffers: bool = False,
        *,
        layer_index: int = 0,
        backend: DeviceBackend | None = None,
        host_buffers: HostBufferPool | None = None,
        min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL,
        min_offload_bytes: int = 0,
        stats: OffloadStats | None = None,
        name: str | None = None,
        copy_timer: CopyTimer | None = None,
    ) -> None:
        if backend is None:
            backend = get_backend()
        if offload_stream is None:
            offload_stream = backend.new_stream()
        if host_buffers is None:
            host_buffers = HostBufferPool(backend, retain_pinned_cpu_buffers)
        self.layer_index = layer_index
        self.name = name or f"layer {layer_index}"
        self.backend = backend
        self.offload_stream = offload_stream
        self.host_buffers = host_buffers
        self.min_offload_numel = min_offload_numel
        self.min_offload_bytes = min_offload_bytes
        self.stats = stats if stats is not None else OffloadStats()
        self.copy_timer = copy_timer
        #: advice given when a layer must be reloaded on demand in its first backward
        #: (None: such a reload is expected, and silent)
        self.reload_advice: str | None = (
            "Call the sync function on every layer's output to prefetch it."
        )
        #: called once, at the first pop of a push cycle (a chunk prefetches the one
        #: before it: see ``chunked.py``)
        self.on_first_pop: Callable[[], None] | None = None
        #: what this state belongs to, kept alive as long as the state is (a chunk's
        #: forward: see ``chunked.py``)
        self.owner: Any = None
        self.state = _NOT_OFFLOADED
        self.generation = 0
        #: the most elements of a tensor kept only for being under ``min_offload_numel``
        self.largest_below_threshold = 0
        #: the current push cycle's data: made by its first push of a tensor to copy
        #: (most layer states never have one), gone with its lease
        self._data: LayerData | None = None
        self._held_lease: Lease | None = None  # strong: tensors pushed by hand
        self._backward_done = False  # the cycle's backward released the layer

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
    @eager
    def push_tensor(self, tensor: Any) -> Any:
        """Take a tensor autograd saves; return what the pop will need (NOTE [Handles])."""
        if self._backward_done:
            self._start_new_cycle()
        if self.state is not _NOT_OFFLOADED:
            self._transition("push_tensor")  # raises
        kind = type(tensor)
        if kind is not _Tensor:
            return kept_handle(tensor, self) if kind is _Parameter else self._push_other(tensor)
        numel = tensor.numel()
        if numel < self.min_offload_numel:  # the common reason, checked first
            if self.largest_below_threshold < numel and type(tensor._base) is not _Parameter:
                self.largest_below_threshold = numel  # (a weight's view is no activation)
            return kept_handle(tensor, self)
        marks = marks_of(tensor)
        reason = plain_kept_because(
            tensor, numel, self.backend.device, self.min_offload_bytes, marks
        )
        if reason is not None:
            if reason is NOT_DENSE:
                warn_not_dense(tensor)
            return kept_handle(tensor, self)
        data = self._data
        if data is None:
            lease = Lease(self)
            data = self._new_cycle(lease)
        else:
            lease = cast(Lease, data.lease())  # alive: the data goes with it
        event = marks.ready_event if marks is not None else None
        if event is None:
            # Covered by the one event start_offload records on the push stream,
            # unless the tensor was saved while another stream was current.
            key = self.backend.current_stream_key()
            if data.push_stream is None:
                data.push_stream, data.push_stream_key = self.backend.current_stream(), key
            elif key != data.push_stream_key:
                event = self.backend.record_event()
        index = len(data.pushed)
        data.versions.append(tensor._version)
        original = weakref.ref(tensor)
        data.originals.append(original)
        # What the layer holds: see NOTE [Saved tensors without their history].
        base = tensor._base
        if base is not None and offloads_through_base(tensor, marks):
            alias = data.alias_view(index, tensor, base)
        else:
            alias = data.alias_of(tensor, original)
        data.pushed.append(alias)
        data.ready.append(event)
        return (lease, index)

    def _new_cycle(self, lease: Lease) -> LayerData:
        """The first push of a tensor to copy in this cycle: its data, which goes when
        ``lease`` does (the handles hold it)."""
        data = self._data = LayerData(lease)
        weakref.finalize(lease, self._graph_released, self.generation).atexit = False
        return data

    def push_by_hand(self, tensor: Any) -> Any:
        """Push a tensor that no pack hook saved (TransformerEngine's by-hand use).

        The layer holds what was pushed by hand until it is released, whether or not
        the caller keeps the handle, as TransformerEngine's layer state does.
        """
        handle = self.push_tensor(tensor)
        self._held_lease = self._data.lease() if self._data is not None else None
        return handle

    def _push_other(self, obj: Any) -> Any:
        """Tensor subclasses, objects saved as their components."""
        if has_saving_protocol(obj):
            return self._push_decomposed(obj)
        if isinstance(obj, torch.Tensor):
            return kept_handle(obj, self)  # subclasses stay (see selection.is_offloadable)
        return verbatim(obj)

    def _push_decomposed(self, tensor: Any) -> Any:
        components, obj = decompose(tensor)
        parts = [None if c is None else self.push_tensor(c) for c in components]
        if not any(is_moved_handle(part) for part in parts):
            # Nothing moved: keep the original object.
            obj.restore_from_saved(components)
            if isinstance(tensor, torch.Tensor):
                return kept_handle(tensor, self)
            return verbatim(tensor)
        return Decomposed(parts, obj)

    def pop_tensor(self, handle: Any) -> Any:
        """Give back what :meth:`push_tensor` took, on the device."""
        if not is_moved_handle(handle) or handle[0].layer is not self:
            return unpack_saved(handle)
        return self.pop_leased(handle[0], handle[1])

    def pop_leased(self, lease: Lease, index: int, prefetch: bool = True) -> torch.Tensor:
        """The tensor pushed at ``index`` of the cycle of ``lease`` (the unpack of a
        moved handle); ``prefetch``: run the first-pop callback (see ``on_first_pop``)."""
        data = self._data
        if data is None or data.lease() is not lease:
            raise OffloadStateError(
                f"cpu_offload: a saved tensor of {self.name} was used after the layer's "
                "data was released and the layer state reused for another forward pass. "
                "Use one layer state per layer and forward pass (the synchronizers do)."
            )
        if prefetch and self.on_first_pop is not None:
            callback, self.on_first_pop = self.on_first_pop, None
            callback()
        pushed = data.pushed  # the aliases while held, else their version keepers
        counter = pushed[index] if pushed else data.keepers[index]
        if counter._version != data.versions[index]:
            self._raise_modified(data, index, counter._version)
        state = self.state
        if state is not _RELOAD_STARTED:
            if state is not _OFFLOAD_FINISHED:  # not copied, or being copied
                return pushed[index]
            self._reload_on_demand()
        backend = self.backend
        if data.reload_event is not None:
            key = backend.current_stream_key()
            if key != data.reload_waited_on:  # once per layer and stream
                backend.wait_event(backend.current_stream(), data.reload_event)
                data.reload_waited_on = key
        tensor = data.reloaded[index]
        if backend.checks_handoff:
            backend.before_handoff(tensor, self.name)
        return tensor

    def _raise_modified(self, data: LayerData, index: int, found: int) -> None:
        """Autograd's error for a saved tensor modified in place (NOTE [Version counter checks])."""
        if index in data.modified:
            where = "it was modified after it was saved by {} and before its copy to the host"
        else:
            where = "it was saved by {} and modified after that"
        like = data.originals[index]()  # the user's tensor, else one of its shape
        if like is None:
            like = data.pushed[index] if data.pushed else None
        if like is None and data.reloaded:
            like = data.reloaded[index]
        desc = describe(like) if like is not None else "a tensor"
        raise modified_error(desc, found, data.versions[index], where.format(self.name))

    def _reload_on_demand(self) -> None:
        if not self._backward_done:  # a second backward reloads on demand by design
            self.stats.on_demand_reloads += 1
            if self.stats.on_demand_reloads == 1 and self.reload_advice is not None:
                warnings.warn(
                    f"cpu_offload: {self.name} was needed by backward before its reload was "
                    "scheduled; it is reloaded now, without overlap with compute. "
                    f"{self.reload_advice} This warning is shown once.",
                    stacklevel=5,
                )
        self.start_reload()

    # ---------------------------------------------------------- transitions

    def start_offload(self) -> None:
        """Queue device-to-host copies of the layer's tensors on the offload stream."""
        self._transition("start_offload")
        data = self._data
        if data is not None:
            data.aliases = {}  # no more pushes: only the lists hold the tensors now
            if data.pushed:
                data.copy_out(self)

    def release_activation_forward_gpu_memory(self) -> None:
        """Drop the device copies once the offload has read them."""
        self._transition("release_activation_forward_gpu_memory")
        data = self._data
        if data is not None:
            data.wait_for_copies(self)
            data.drop_pushed()
            data.unique = []

    def start_reload(self) -> None:
        """Queue host-to-device copies on the offload stream, one event for the layer."""
        self._transition("start_reload")
        if self._data is not None:
            self._data.copy_in(self)

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
        data.wait_for_copies(self)
        data.drop_pushed()
        data.reloaded, data.unique = [], []
        self._backward_done = True
        self.state = _OFFLOAD_FINISHED

    def _start_new_cycle(self) -> None:
        """A state reused for a new forward after its backward: the old graph's
        handles lose their data (popping one raises)."""
        self._held_lease = None
        self._drop_data()
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
        if data is not None:
            data.release(self)

    # -------------------------------------------------------------- queries

    def holds_data(self) -> bool:
        """Whether a push cycle's data is alive: handles autograd may still unpack, or
        tensors pushed by hand."""
        data = self._data
        return self._held_lease is not None or (data is not None and data.lease() is not None)

    def holds_storage(self, cdata: int) -> bool:
        """Whether a tensor pushed to be offloaded, not yet copied, lives in the storage
        ``cdata`` (a ``StorageWeakRef``'s)."""
        data = self._data
        return data is not None and any(t.untyped_storage()._cdata == cdata for t in data.pushed)

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
