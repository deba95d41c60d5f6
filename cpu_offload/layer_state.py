"""The per-layer state machine: the mechanism that copies a layer's saved tensors.

A layer state only knows how to push, offload, release, reload and pop; when to do
each is decided by a synchronizer (``synchronizer.py``).

NOTE [Offload stream ordering]
    push:    the device tensor is kept; the layer remembers the stream current at
             its first push.  A tensor gets an event of its own only when
             ``start_offload`` recorded one for it or another stream is current.
    offload: one event recorded on the push stream covers every tensor pushed
             there (the stream orders the layer's work); the offload stream waits
             for it and for the tensors' own events before copying, so a copy never
             reads a tensor that compute is still writing.
    release: the compute stream waits for the offload finish event before the
             device references are dropped; the caching allocator may hand that
             memory to later compute work only after the copies have read it.
    reload:  device tensors are allocated on the compute stream, then the offload
             stream waits for the compute stream (the new memory may have been in
             use by compute work just issued), then copies.  One event per layer.
    pop:     the first pop of the layer on a stream makes that stream wait for the
             reload event.
    release all: the compute stream waits for copies still in flight (an offload
             never released, reloads never popped) before dropping the tensors.

NOTE [Lifetime of a layer's data]
    The handles a pack hook returns share one :class:`_Lease` per layer and push
    cycle; autograd holds the handles as long as the graph may still unpack them.
    When the last handle dies (backward freed its saved tensors, or the graph was
    dropped) the lease's finalizer waits for copies in flight and gives the host
    buffers back to the pool.  Until then the host copies stay: after its backward
    a layer drops its device tensors but keeps its host copies, so a second
    backward through the same graph (``retain_graph=True``, ``create_graph=True``)
    reloads it again.

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
import types
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
from .host_buffers import HostBufferPool
from .marks import TensorMarks, marks_of, set_mark
from .selection import DEFAULT_MIN_OFFLOAD_NUMEL, NOT_DENSE, plain_kept_because, warn_not_dense
from .stats import OffloadStats
from .tensor_group import GroupLayout, TensorGroup, TensorGroupProcessor, offloads_through_base

__all__ = [
    "TRANSITIONS",
    "LayerState",
    "OffloadableLayerState",
    "SharedHandle",
    "Transition",
    "decompose",
    "has_saving_protocol",
    "is_moved_handle",
    "unpack_saved",
]


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


def has_saving_protocol(obj: object) -> bool:
    """Whether ``obj`` decomposes itself for saving (``prepare_for_saving``)."""
    return callable(getattr(obj, "prepare_for_saving", None))


def decompose(obj: Any) -> tuple[list[torch.Tensor | None], Any]:
    """``obj``'s components and the emptied object that ``restore_from_saved`` refills
    (a tensor is detached first, as autograd saves it)."""
    saved: Any = obj.detach() if isinstance(obj, torch.Tensor) else obj
    return saved.prepare_for_saving()


_NOT_OFFLOADED = LayerState.NOT_OFFLOADED
_OFFLOAD_FINISHED = LayerState.OFFLOAD_FINISHED
_RELOAD_STARTED = LayerState.RELOAD_STARTED
_Tensor = torch.Tensor
_Parameter = Parameter
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def _without_grad(method: Callable[[], None]) -> None:
    """``method()`` with grad mode off: a copy must not enter the graph (a host buffer
    would keep it alive).  What ``torch.no_grad`` does, for a tenth of its cost, paid per
    layer on the hooks' path."""
    if not _grad_enabled():
        method()
        return
    _set_grad_enabled(False)
    try:
        method()
    finally:
        _set_grad_enabled(True)


def _modified_error(tensor_desc: str, found: int, expected: int, where: str) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{tensor_desc}] is at version {found}; expected version "
        f"{expected} instead. (cpu_offload: {where}.) Hint: find the in-place operation "
        "on this tensor after it was saved and make it out of place."
    )


def _describe(tensor: torch.Tensor) -> str:
    return f"{tensor.type()} {list(tensor.shape)}"


#: per device, the empty tensor whose (absent) memory version keepers point at
_NO_MEMORY: dict[torch.device, torch.Tensor] = {}


def _version_keeper(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``tensor``'s version counter and holds none of its memory
    (NOTE [Version counter checks]): ``detach()`` shares the counter, and assigning
    ``.data`` swaps the memory without touching the counter."""
    keeper = tensor.detach()
    device = tensor.device
    empty = _NO_MEMORY.get(device)
    if empty is None:
        empty = _NO_MEMORY[device] = torch.empty(0, device=device)
    keeper.data = empty
    return keeper


_NOT_WAITED = object()
#: an empty list that is a tuple, and an empty dict that is read-only: see _reset_data
_NONE_YET: list[Any] = cast(list, ())
_NO_ENTRIES: dict[Any, Any] = cast(dict, types.MappingProxyType({}))


class _Lease:
    """Shared by the handles of one layer's push cycle; see NOTE [Lifetime of a layer's data]."""

    __slots__ = ("layer", "__weakref__")

    def __init__(self, layer: OffloadableLayerState) -> None:
        self.layer = layer


# NOTE [Handles]
#     What the pack hook returns, and autograd holds until the unpack hook, is built
#     once per saved tensor, so it is a plain tuple (a tuple costs a fifth of an object
#     with an ``__init__``):
#         ``(lease, index)``          a tensor the layer may copy: its lease and position;
#         ``(tensor, version, layer)`` a tensor that stays where it is, without history,
#                                     and its version at push (checked at unpack).
#     Anything else the hook may return is an object of its own class (``_Decomposed``,
#     ``_Verbatim``, ``SharedHandle``) or an object pushed by hand that is no tensor
#     (itself), never a tuple.


def _kept(tensor: torch.Tensor, layer: OffloadableLayerState) -> tuple:
    """The handle of a tensor that stays: an output saved by its own node would hold
    that node, so it is held without history (NOTE [Saved tensors without their
    history]; ``is_leaf`` is False exactly when there is a ``grad_fn``)."""
    return (tensor if tensor.is_leaf else tensor.detach(), tensor._version, layer)


def is_moved_handle(handle: object) -> bool:
    """Whether ``handle`` (a pack hook's result) stands for a tensor the layer may copy."""
    return type(handle) is tuple and len(handle) == 2


class _Verbatim:
    """A tuple pushed by hand, wrapped: a handle that is a tuple means a tensor."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def _verbatim(obj: Any) -> Any:
    """The handle of an object pushed that is no tensor: the object itself (unless a tuple)."""
    return _Verbatim(obj) if isinstance(obj, tuple) else obj


class SharedHandle:
    """A handle to a tensor that another save already handed to a layer (NOTE [A tensor
    saved in several chunks] in chunked.py): it unpacks that tensor without starting
    the layer's first-pop prefetch."""

    __slots__ = ("lease", "index")

    def __init__(self, lease: _Lease, index: int) -> None:
        self.lease = lease
        self.index = index


class _Decomposed:
    """What the pack hook returns for an object saved as its components."""

    __slots__ = ("parts", "obj")

    def __init__(self, parts: list[Any], obj: Any) -> None:
        self.parts = parts
        self.obj = obj


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
        self._lease: weakref.ref[_Lease] | None = None  # weak: handles own the lease
        self._held_lease: _Lease | None = None  # strong: tensors pushed by hand
        self._reset_data()

    def _reset_data(self) -> None:
        # The push cycle's lists are made by its first push of a tensor to copy
        # (_new_lease): most layer states never have one, and an empty tuple costs
        # nothing to make (appending to one would raise, as writing to _NO_ENTRIES).
        self._pushed: list[torch.Tensor] = _NONE_YET  # device tensors as pushed, one per handle
        # per pushed position once the device tensors are dropped: its version keeper
        self._keepers: list[torch.Tensor] = _NONE_YET
        self._ready: list[Any] = _NONE_YET  # per pushed position: its ready event, or None
        self._versions: list[int] = _NONE_YET  # per pushed position: version at push
        self._originals: list[weakref.ref[torch.Tensor]] = _NONE_YET  # per pushed position
        # id(tensor) -> (weak tensor, its alias): one alias per tensor object
        self._aliases: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = _NO_ENTRIES
        self._modified: dict[int, int] = _NO_ENTRIES  # pushed position -> version seen at copy
        # Whether group processing has work: a view moves through its base, or a tensor
        # was pushed twice.  Otherwise the pushed tensors are copied as they are.
        self._grouped = False
        self._layout: GroupLayout | None = None  # how to undo group processing
        self._unique: list[torch.Tensor] = _NONE_YET  # after group processing, being copied
        self._host: list[torch.Tensor | None] = _NONE_YET  # None: over max_host_bytes, stays
        self._stay: list[torch.Tensor | None] = _NONE_YET  # per unique tensor: kept on the device
        self._host_bytes = 0  # bytes of the host copies
        self._reloaded: list[torch.Tensor] = _NONE_YET  # per pushed position, after reload
        self._in_flight: list[Any] = _NONE_YET  # events of copies nobody has waited for
        self._push_stream: Any = None  # current stream at the first push
        self._push_stream_key: Any = None
        self._reload_event: Any = None  # recorded after the layer's reload copies
        self._reload_waited_on: Any = _NOT_WAITED  # stream key that waited for it
        self._backward_done = False

    # ---------------------------------------------------------------- guards

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
            return _kept(tensor, self) if kind is _Parameter else self._push_other(tensor)
        numel = tensor.numel()
        if numel < self.min_offload_numel:  # the common reason, checked first
            if self.largest_below_threshold < numel and type(tensor._base) is not _Parameter:
                self.largest_below_threshold = numel  # (a weight's view is no activation)
            return _kept(tensor, self)
        marks = marks_of(tensor)
        reason = plain_kept_because(
            tensor, numel, self.backend.device, self.min_offload_bytes, marks
        )
        if reason is not None:
            if reason is NOT_DENSE:
                warn_not_dense(tensor)
            return _kept(tensor, self)
        event = marks.ready_event if marks is not None else None
        if event is None:
            # Covered by the one event start_offload records on the push stream,
            # unless the tensor was saved while another stream was current.
            key = self.backend.current_stream_key()
            if self._push_stream is None:
                self._push_stream, self._push_stream_key = self.backend.current_stream(), key
            elif key != self._push_stream_key:
                event = self.backend.record_event()
        lease = self._lease() if self._lease is not None else None
        if lease is None:
            lease = self._new_lease()
        index = len(self._pushed)
        self._versions.append(tensor._version)
        original = weakref.ref(tensor)
        self._originals.append(original)
        # What the layer holds: see NOTE [Saved tensors without their history].
        base = tensor._base
        if base is not None and offloads_through_base(tensor, marks):
            alias = self._alias_view(tensor, base, marks)
        else:
            alias = self._alias_of(tensor, original)
        self._pushed.append(alias)
        self._ready.append(event)
        return (lease, index)

    def _new_lease(self) -> _Lease:
        """The first push of a tensor to copy in this cycle: its lease and lists."""
        self._pushed, self._ready, self._versions, self._originals = [], [], [], []
        self._aliases, self._modified = {}, {}
        lease = _Lease(self)
        self._lease = weakref.ref(lease)
        weakref.finalize(lease, self._graph_released, self.generation).atexit = False
        return lease

    def _alias_view(
        self, tensor: torch.Tensor, base: torch.Tensor, marks: TensorMarks | None
    ) -> torch.Tensor:
        """A view that moves through its base: the same view of the base's one alias."""
        self._grouped = True
        base_alias = self._alias_of(base, None)
        view = base_alias.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        if marks is not None and marks.offload_base:
            set_mark(view, offload_base=True)  # the group processing reads the mark
        return view

    def _alias_of(
        self, tensor: torch.Tensor, ref: weakref.ref[torch.Tensor] | None
    ) -> torch.Tensor:
        """One alias without history per tensor object, so a tensor pushed twice is
        copied once (group processing then has work); ``ref``: a weak reference to
        ``tensor`` already made, if any."""
        key = id(tensor)
        entry = self._aliases.get(key)
        if entry is not None and entry[0]() is tensor:
            self._grouped = True
            return entry[1]
        alias = tensor if tensor.is_leaf and tensor._base is None else tensor.detach()
        self._aliases[key] = (ref if ref is not None else weakref.ref(tensor), alias)
        return alias

    def push_by_hand(self, tensor: Any) -> Any:
        """Push a tensor that no pack hook saved (TransformerEngine's by-hand use).

        The layer holds what was pushed by hand until it is released, whether or not
        the caller keeps the handle, as TransformerEngine's layer state does.
        """
        handle = self.push_tensor(tensor)
        self._held_lease = self._lease() if self._lease is not None else None
        return handle

    def _push_other(self, obj: Any) -> Any:
        """Tensor subclasses, objects saved as their components."""
        if has_saving_protocol(obj):
            return self._push_decomposed(obj)
        if isinstance(obj, torch.Tensor):
            return _kept(obj, self)  # subclasses stay (see selection.is_offloadable)
        return _verbatim(obj)

    def _push_decomposed(self, tensor: Any) -> Any:
        components, obj = decompose(tensor)
        parts = [None if c is None else self.push_tensor(c) for c in components]
        if not any(is_moved_handle(part) for part in parts):
            # Nothing moved: keep the original object.
            obj.restore_from_saved(components)
            return _kept(tensor, self) if isinstance(tensor, torch.Tensor) else _verbatim(tensor)
        return _Decomposed(parts, obj)

    def pop_tensor(self, handle: Any) -> Any:
        """Give back what :meth:`push_tensor` took, on the device."""
        if not is_moved_handle(handle) or handle[0].layer is not self:
            return unpack_saved(handle)
        return self._pop(handle[0], handle[1])

    def _pop(self, lease: _Lease, index: int, prefetch: bool = True) -> torch.Tensor:
        if self._lease is None or self._lease() is not lease:
            raise OffloadStateError(
                f"cpu_offload: a saved tensor of {self.name} was used after the layer's "
                "data was released and the layer state reused for another forward pass. "
                "Use one layer state per layer and forward pass (the synchronizers do)."
            )
        if prefetch and self.on_first_pop is not None:
            callback, self.on_first_pop = self.on_first_pop, None
            callback()
        pushed = self._pushed  # the aliases while held, else their version keepers
        counter = pushed[index] if pushed else self._keepers[index]
        if counter._version != self._versions[index]:
            self._raise_modified(index, counter._version)
        state = self.state
        if state is not _RELOAD_STARTED:
            if state is not _OFFLOAD_FINISHED:  # not copied, or being copied
                return self._pushed[index]
            self._reload_on_demand()
        backend = self.backend
        if self._reload_event is not None:
            key = backend.current_stream_key()
            if key != self._reload_waited_on:  # once per layer and stream
                backend.wait_event(backend.current_stream(), self._reload_event)
                self._reload_waited_on = key
        tensor = self._reloaded[index]
        if backend.checks_handoff:
            backend.before_handoff(tensor, self.name)
        return tensor

    def _raise_modified(self, index: int, found: int) -> None:
        """Autograd's error for a saved tensor modified in place (NOTE [Version counter checks])."""
        if index in self._modified:
            where = "it was modified after it was saved by {} and before its copy to the host"
        else:
            where = "it was saved by {} and modified after that"
        like = self._originals[index]()  # the user's tensor, else one of its shape
        if like is None:
            like = self._pushed[index] if self._pushed else None
        if like is None and self._reloaded:
            like = self._reloaded[index]
        desc = _describe(like) if like is not None else "a tensor"
        raise _modified_error(desc, found, self._versions[index], where.format(self.name))

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
        self._aliases = _NO_ENTRIES  # no more pushes: only the lists hold the tensors now
        if self._pushed:
            _without_grad(self._start_copies_out)

    def _start_copies_out(self) -> None:
        pushed, ready, versions, backend = self._pushed, self._ready, self._versions, self.backend
        # A tensor modified in place since its push will never be handed back (its
        # unpack raises), but its copy must still be ordered after the modifying work.
        for index, tensor in enumerate(pushed):
            if tensor._version != versions[index]:
                self._modified[index] = tensor._version
                ready[index] = backend.record_event()
        if self._grouped:
            group = TensorGroupProcessor.process_before_offload(TensorGroup(pushed, ready))
            unique, self._layout = group.tensor_list, group.aux
        else:
            unique = pushed  # one copy per pushed tensor, as it is
        self._unique = unique
        sizes = [t.nbytes for t in unique]
        self._host = host = self.host_buffers.acquire(self.layer_index, unique, sizes)
        stream = self.offload_stream
        if self._push_stream is not None:  # covers every tensor pushed on that stream
            backend.wait_event(stream, backend.record_event(self._push_stream))
        waited: set[int] = set()
        for event in ready:  # marked tensors, other streams, modified tensors
            if event is not None and id(event) not in waited:
                waited.add(id(event))
                backend.wait_event(stream, event)
        if self.host_buffers.max_bytes is not None and any(h is None for h in host):
            # The pool is at max_host_bytes: what got no buffer stays on the device.
            self._stay = [t if h is None else None for h, t in zip(host, unique)]
            sizes = [n for n, h in zip(sizes, host) if h is not None]
        self._host_bytes = sum(sizes)
        hosts, sources = self._with_host(unique)
        self._copy("d2h", hosts, sources)
        self._in_flight = [backend.record_event(stream)]

    def _with_host(
        self, device_tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The host buffers and the device tensors (one per unique tensor) of the tensors
        that have a buffer: all of them, unless the pool was at ``max_host_bytes``."""
        if not self._stay:
            return cast(list[torch.Tensor], self._host), device_tensors
        pairs = [(h, t) for h, t in zip(self._host, device_tensors) if h is not None]
        return [h for h, _ in pairs], [t for _, t in pairs]

    def _copy(self, direction: str, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """The layer's copies in one direction on the offload stream: timed, counted."""
        if not dsts:  # every tensor stayed (max_host_bytes)
            return
        stream, timer = self.offload_stream, self.copy_timer
        start = timer.start(stream) if timer is not None else None
        self.backend.copy_many(dsts, srcs, stream, self.name)
        self.stats.count(direction, len(dsts), self._host_bytes)
        if timer is not None:
            timer.stop(direction, self._host_bytes, start, stream)

    def release_activation_forward_gpu_memory(self) -> None:
        """Drop the device copies once the offload has read them."""
        self._transition("release_activation_forward_gpu_memory")
        self._wait_for_copies()
        self._drop_pushed()
        self._unique = []

    def _drop_pushed(self) -> None:
        """Drop the device tensors as pushed, keeping their version counters (NOTE
        [Version counter checks]); a tensor pushed twice has one keeper."""
        pushed = self._pushed
        if pushed and not self._keepers:
            made: dict[int, torch.Tensor] = {}
            keepers = []
            for tensor in pushed:
                keeper = made.get(id(tensor))
                if keeper is None:
                    keeper = made[id(tensor)] = _version_keeper(tensor)
                keepers.append(keeper)
            self._keepers = keepers
        self._pushed = []

    def start_reload(self) -> None:
        """Queue host-to-device copies on the offload stream, one event for the layer."""
        self._transition("start_reload")
        if not self._host:
            self._reloaded = []
            return
        _without_grad(self._start_copies_in)

    def _start_copies_in(self) -> None:
        backend, stream = self.backend, self.offload_stream
        if self._stay:
            targets = [
                backend.empty_device(host) if host is not None else cast(torch.Tensor, kept)
                for host, kept in zip(self._host, self._stay)
            ]
        else:
            targets = backend.empty_device_many(cast(list[torch.Tensor], self._host))
        backend.wait_stream(stream, backend.current_stream())
        hosts, reloaded = self._with_host(targets)
        self._copy("h2d", reloaded, hosts)
        # One event for the layer: its first pop waits for every copy.
        event = self._reload_event = backend.record_event(stream)
        self._reload_waited_on = _NOT_WAITED
        self._in_flight = [event]
        if self._layout is None:
            self._reloaded = targets
        else:
            group = TensorGroup(targets, [event] * len(targets), aux=self._layout)
            self._reloaded = TensorGroupProcessor.process_after_reload(group).tensor_list

    def release_all_memory(self) -> None:
        """Drop the layer's device tensors after its backward.

        Allowed in every state.  While the graph may still unpack the layer's tensors
        (``retain_graph=True``), offloaded data stays on the host and the layer goes to
        ``OFFLOAD_FINISHED``, from where a second backward reloads it; tensors that were
        never copied stay on the device.  Otherwise everything goes and the layer is
        back to ``NOT_OFFLOADED``.
        """
        self._held_lease = None  # what was pushed by hand lives as long as its handles now
        if self._lease is None or self._lease() is None:
            self._drop_data()
            self.state = _NOT_OFFLOADED
            return
        if self.state is _NOT_OFFLOADED:
            return  # never copied: the device tensors live as long as the graph
        self._wait_for_copies()
        self._drop_pushed()
        self._reloaded, self._unique = [], []
        self._backward_done = True
        self.state = _OFFLOAD_FINISHED

    def _start_new_cycle(self) -> None:
        """A state reused for a new forward after its backward: the old graph's
        handles lose their data (popping one raises)."""
        self._lease = self._held_lease = None
        self._drop_data()
        self.generation += 1
        self.state = _NOT_OFFLOADED

    def _graph_released(self, generation: int) -> None:
        """Finalizer of the lease: no handle of this push cycle is left."""
        if generation != self.generation:
            return  # the state was reused since; that cycle's data is gone already
        self._lease = None
        after_backward = self._backward_done or self.state is _RELOAD_STARTED
        self._drop_data()
        self.generation += 1
        if after_backward:
            self.state = _NOT_OFFLOADED

    def _drop_data(self) -> None:
        if not self._versions:
            return  # nothing was pushed to be copied since the last reset: nothing to drop
        self._wait_for_copies()
        self.host_buffers.release(self.layer_index, self._host)
        self._reset_data()

    def _wait_for_copies(self) -> None:
        """The compute stream waits for copies in flight (see the NOTE above), once."""
        if self._in_flight:
            current = self.backend.current_stream()
            for event in self._in_flight:
                self.backend.wait_event(current, event)
            self._in_flight = []

    # -------------------------------------------------------------- queries

    def holds_data(self) -> bool:
        """Whether a push cycle's data is alive: handles autograd may still unpack, or
        tensors pushed by hand."""
        return self._held_lease is not None or (
            self._lease is not None and self._lease() is not None
        )

    def holds_storage(self, cdata: int) -> bool:
        """Whether a tensor pushed to be offloaded, not yet copied, lives in the storage
        ``cdata`` (a ``StorageWeakRef``'s)."""
        return any(t.untyped_storage()._cdata == cdata for t in self._pushed)

    @property
    def num_offloaded_tensors(self) -> int:
        """Distinct tensors copied (or to be copied) to the host."""
        return sum(h is not None for h in self._host)

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of this layer's data that sits in host memory now."""
        if self.state is _NOT_OFFLOADED:
            return 0.0
        return self._host_bytes / 2**20


@eager
def unpack_saved(handle: Any) -> Any:
    """The unpack hook: turn whatever a pack hook returned back into a tensor."""
    if type(handle) is tuple:  # NOTE [Handles]
        if len(handle) == 2:
            lease, index = handle
            return lease.layer._pop(lease, index)
        tensor, version, layer = handle
        if tensor._version != version:
            raise _modified_error(
                _describe(tensor),
                tensor._version,
                version,
                f"the tensor was saved by {layer.name} and stayed on the device",
            )
        return tensor
    if type(handle) is SharedHandle:
        return handle.lease.layer._pop(handle.lease, handle.index, False)
    if type(handle) is _Decomposed:
        components = [None if part is None else unpack_saved(part) for part in handle.parts]
        handle.obj.restore_from_saved(components)
        return handle.obj
    if type(handle) is _Verbatim:
        return handle.obj
    return handle
