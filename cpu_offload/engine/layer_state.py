"""The per-layer state machine: the mechanism that copies a layer's saved tensors.

A layer state only knows how to push, offload, release, reload and pop; when to do
each is decided by a synchronizer (``synchronizer.py``).  It decides which saved
tensors move (``selection.py``), hands back what the pack hook returns (``handles.py``)
and takes the state machine's transitions; the data of its current push cycle, and the
copies themselves, are a :class:`~cpu_offload.engine.layer_data.LayerData` (NOTE [Offload
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

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.nn import Parameter

from ..device.backend import DeviceBackend
from ..device.runtime import get_backend
from ..errors import OffloadStateError
from ..hooks.eager import eager
from ..hooks.handles import (
    Decomposed,
    Lease,
    describe,
    is_moved_handle,
    kept_handle,
    modified_error,
    unpack_saved,
    verbatim,
)
from ..hooks.marks import marked_tensors, marks_of
from ..hooks.saving_protocol import decompose, has_saving_protocol
from ..hooks.selection import (
    DEFAULT_MIN_OFFLOAD_NUMEL,
    KEPT_BY_MODULES,
    NOT_DENSE,
    SUBCLASS,
    kept_because,
    plain_kept_because,
    warn_not_dense,
)
from ..hooks.tensor_group import offloads_through_base
from ..log import warn
from ..report.copy_timer import CopyTimer
from ..report.profiler_ranges import in_range
from ..report.stats import OffloadStats
from ..report.step_record import nominal_bytes
from .host_buffers import HostBufferPool
from .layer_data import LayerData, hand_out
from .transitions import LayerState, LayerTransitions

__all__ = ["OffloadableLayerState"]


_NOT_OFFLOADED = LayerState.NOT_OFFLOADED
_OFFLOAD_FINISHED = LayerState.OFFLOAD_FINISHED
_RELOAD_STARTED = LayerState.RELOAD_STARTED
_Tensor = torch.Tensor
_Parameter = Parameter


class OffloadableLayerState(LayerTransitions):
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
        super().__init__()
        #: the most elements of a tensor kept only for being under ``min_offload_numel``
        self.largest_below_threshold = 0

    @eager
    def push_tensor(self, tensor: Any) -> Any:
        """Take a tensor autograd saves; return what the pop will need (NOTE [Handles]).

        A tensor that stays is counted for the step report where the reason is known
        (NOTE [Counting saved tensors for nearly nothing] in step_record.py), and its
        handle is made here rather than by ``kept_handle`` (a call per tensor saved).
        """
        if self._backward_done:
            self._start_new_cycle()
        if self.state is not _NOT_OFFLOADED:
            self._transition("push_tensor")  # raises
        kind = type(tensor)
        if kind is not _Tensor:
            if kind is _Parameter:  # a leaf: held as it is
                self.kept_fast.append(~tensor.nbytes)
                return (tensor, tensor._version, self)
            return self._push_other(tensor)
        numel = tensor.numel()
        if numel < self.min_offload_numel:  # the common reason, checked first
            self.kept_fast.append(numel * tensor.itemsize)
            if self.largest_below_threshold < numel and type(tensor._base) is not _Parameter:
                self.largest_below_threshold = numel  # (a weight's view is no activation)
            return (tensor if tensor.is_leaf else tensor.detach(), tensor._version, self)
        marks = marks_of(tensor) if marked_tensors else None
        base, grad_fn = tensor._base, tensor.grad_fn  # (``is_leaf`` is ``grad_fn is None``)
        reason = plain_kept_because(
            tensor, numel, self.backend.device, self.min_offload_bytes, marks, base, grad_fn
        )
        if reason is not None:
            if reason is NOT_DENSE:
                warn_not_dense(tensor)
            self.saves.kept.append((reason, numel * tensor.itemsize))
            return (tensor if grad_fn is None else tensor.detach(), tensor._version, self)
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
            backend = self.backend
            if data.push_stream is None:
                data.push_stream = backend.current_stream()
                data.push_stream_key = backend.current_stream_key()
            elif not backend.one_stream and backend.current_stream_key() != data.push_stream_key:
                event = backend.record_event()
        index = len(data.pushed)
        data.versions.append(tensor._version)
        original = weakref.ref(tensor)
        data.originals.append(original)
        # What the layer holds: see NOTE [Saved tensors without their history].
        if base is not None and offloads_through_base(tensor, marks):
            alias = data.alias_view(index, tensor, base)
        else:
            alias = data.alias_of(tensor, original, grad_fn is None and base is None)
        data.pushed.append(alias)
        data.ready.append(event)
        return (lease, index)

    @eager
    def keep_tensor(self, tensor: torch.Tensor) -> tuple:
        """Take a tensor autograd saves that stays on the device, whatever it is (a
        submodule's, which ``offload_layers(..., modules=...)`` keeps); counted for the
        step report as :meth:`push_tensor` counts, under its own reason where no other
        would have kept it."""
        if self._backward_done:
            self._start_new_cycle()
        if self.state is not _NOT_OFFLOADED:
            self._transition("push_tensor")  # raises
        kind, numel = type(tensor), tensor.numel()
        if kind is _Parameter:
            self.kept_fast.append(~tensor.nbytes)
        elif kind is not _Tensor:
            self.saves.kept.append((SUBCLASS, nominal_bytes(tensor)))
        elif numel < self.min_offload_numel:
            self.kept_fast.append(numel * tensor.itemsize)
        else:
            device, least = self.backend.device, self.min_offload_numel
            reason = kept_because(tensor, device, least, self.min_offload_bytes)
            self.saves.kept.append((reason or KEPT_BY_MODULES, numel * tensor.itemsize))
        return kept_handle(tensor, self)

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
        if isinstance(obj, torch.Tensor):  # subclasses stay (see selection.is_offloadable)
            self.saves.kept.append((SUBCLASS, nominal_bytes(obj)))
            return kept_handle(obj, self)
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
        backend, slices = self.backend, self.slices  # slices: see reload_slices.py
        if slices is None and data.reload_event is not None:
            key = None if backend.one_stream else backend.current_stream_key()
            if key != data.reload_waited_on:  # once per layer and stream
                stream, event = backend.current_stream(), data.reload_event
                in_range("wait_reload", self.name, backend.wait_event, stream, event)
                _waited(data, backend, key, stream)
        held = None if slices is not None or data.pops_left else data.reloaded[index]
        if held is not None:  # let go of it: ``hand_out``'s common case, without the call
            tensor, data.reloaded[index] = held, None
        else:
            tensor = (hand_out if slices is None else slices.hand_out)(data, self, index)
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
            self.saves.on_demand = True
            self.stats.on_demand_reloads += 1
            if self.stats.on_demand_reloads == 1 and self.reload_advice is not None:
                warn(
                    f"cpu_offload: {self.name} was needed by backward before its reload was "
                    "scheduled; it is reloaded now, without overlap with compute. "
                    f"{self.reload_advice} This warning is shown once.",
                    stacklevel=5,
                )
        self.start_reload()

    # ---------------------------------------------------------- transitions


def _waited(data: LayerData, backend: DeviceBackend, key: object, stream: Any) -> None:
    """``stream`` (``key``) waited for the layer's reload.  On a stream other than the one
    the reload allocated on, the reloaded tensors are handed to ``record_stream`` for it:
    their blocks go back to the reload stream's pool, which would reuse them while this
    stream still reads them (NOTE [Allocator reuse across streams] in testing/)."""
    data.reload_waited_on = key
    if key is not None and key != data.reload_stream_key:  # None: one stream
        for tensor in data.reloaded:
            if tensor is not None:
                backend.record_stream(tensor, stream)
