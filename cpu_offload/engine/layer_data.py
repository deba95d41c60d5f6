"""One push cycle of a layer: the tensors it may copy, their copies, and the copying.

A layer state (``layer_state.py``) decides which saved tensors move and takes the state
machine's transitions; the :class:`LayerData` of its current push cycle holds what those
transitions work on (the device tensors as pushed, their versions and ready events, the
group layout, the host copies and the reloaded tensors) and issues the copies.  It is
made at the layer's first push of a tensor to copy, and goes when the cycle's handles do
(NOTE [Lifetime of a layer's data] in handles.py).

NOTE [Offload stream ordering]
    push:    the device tensor is kept; the cycle remembers the stream current at
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

NOTE [Reloaded tensors go one by one]
    A reloaded tensor's pop hands it to autograd and the layer lets go of it: its
    memory goes when autograd's own use of it ends (the node that unpacked it is
    done), not when the layer's backward ends, as a per-tensor offloader's would.
    Positions that share one reloaded tensor (a tensor saved by several nodes, views
    moved through their base) each hold it until their own pop, so it goes with the
    last of them; a chunk's shared handle (NOTE [A tensor saved in several chunks] in
    chunked.py) counts as one pop more.  A position popped again within one reload (a
    node unpacking a saved tensor twice, a graph walked again before the layer was
    released) gets a new copy of its host copy, made on the compute stream: the host
    copies live as long as the graph.  Every pop has waited for the layer's reload
    event before its tensor is handed out, so memory freed this way is never written
    by a copy still queued.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, cast

import torch

from ..device.backend import DeviceBackend
from ..hooks.handles import Lease
from ..hooks.tensor_group import GroupLayout, TensorGroup, TensorGroupProcessor
from ..report.copy_timer import CopyTimer
from ..report.stats import OffloadStats
from ..report.step_record import SaveCounts
from .host_buffers import HostBufferPool

__all__ = ["NOT_WAITED", "CopyingLayer", "LayerData", "count_moves", "hand_out"]
__all__ += ["copy_timed", "pushed_bytes", "version_keeper"]

#: ``LayerData.reload_waited_on`` before any stream waited for the reload
NOT_WAITED = object()

#: per device, the empty tensor whose (absent) memory version keepers point at
_NO_MEMORY: dict[torch.device, torch.Tensor] = {}
_grad_enabled = torch.is_grad_enabled
_clone = torch.Tensor.clone
_set_grad_enabled = torch._C._set_grad_enabled


def version_keeper(tensor: torch.Tensor, own: bool = False) -> torch.Tensor:
    """A tensor that shares ``tensor``'s version counter and holds none of its memory
    (NOTE [Version counter checks] in layer_state.py): assigning ``.data`` swaps the
    memory without touching the counter, on ``tensor`` itself when it is ``own`` (an
    alias nothing else uses), else on a ``detach()`` of it, which shares the counter.
    A view is never its own keeper: it holds its base (``_base``), and with it the
    base's memory, whatever its ``.data``."""
    keeper = tensor if own and tensor._base is None else tensor.detach()
    keeper.data = _no_memory(tensor.device)
    return keeper


def _no_memory(device: torch.device) -> torch.Tensor:
    """The empty tensor of ``device`` that version keepers point at."""
    if device not in _NO_MEMORY:
        _NO_MEMORY[device] = torch.empty(0, device=device)
    return _NO_MEMORY[device]


class CopyingLayer(Protocol):
    """What the copies ask of the layer state they copy for (``layer_state.py``)."""

    layer_index: int
    name: str
    backend: DeviceBackend
    offload_stream: Any
    host_buffers: HostBufferPool
    stats: OffloadStats
    copy_timer: CopyTimer | None


class _NoGrad:
    """Grad mode off around a layer's copies (a copy must not enter the graph: a host
    buffer would keep it alive); ``torch.no_grad`` at a tenth of its cost, per layer."""

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = _grad_enabled()
        if self.was:
            _set_grad_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        if self.was:
            _set_grad_enabled(True)


class LayerData:
    """What one push cycle of a layer holds; see the module.

    Attributes:
        lease: the cycle's lease (weakly: the handles own it).
        pushed: the device tensors as pushed (aliases without history), one per
            handle, until the layer drops them; then
        keepers: per pushed position, its version keeper.
        versions: per pushed position, its version at push.
        ready: per pushed position, its ready event, or None (the push stream's covers it).
        originals: per pushed position, the user's tensor (weakly).
        aliases: ``id(tensor) -> (weak tensor, its alias)`` while pushes come: one
            alias per tensor object, so a tensor pushed twice is copied once.
        via_base: pushed positions of views that move through their base; None: none.
        grouped: whether group processing has work (a view moves through its base, or
            a tensor was pushed twice); otherwise tensors are copied as they are.
        leaves: whether a tensor pushed is held as it is (a leaf: the user's own tensor).
        modified: ``pushed position -> version`` of tensors modified before their copy.
        layout: how to undo group processing.
        unique: the device tensors being copied (after group processing).
        layouts: per unique tensor, its ``(shape, stride, dtype)``.
        host: per unique tensor, its host buffer (None: over ``max_host_bytes``, stays);
        stay: per unique tensor that stays, the tensor (else None); empty if none stays.
        host_bytes: bytes of the host copies.
        reloaded: per pushed position, the tensor after reload, None once popped.
        shares, pops_left: position -> pops beyond its handle's (None: none), all and left.
        in_flight: events of copies nobody has waited for.
        push_stream, push_stream_key: the stream current at the first push.
        reload_event, reload_waited_on, reload_stream_key: the reload's event, the stream
            key that waited for it, and the one its tensors were allocated on.
    """

    __slots__ = (
        "lease",
        "pushed",
        "keepers",
        "versions",
        "ready",
        "originals",
        "aliases",
        "via_base",
        "grouped",
        "leaves",
        "modified",
        "layout",
        "layouts",
        "unique",
        "host",
        "stay",
        "host_bytes",
        "reloaded",
        "shares",
        "pops_left",
        "in_flight",
        "push_stream",
        "push_stream_key",
        "reload_event",
        "reload_waited_on",
        "reload_stream_key",
    )

    def __init__(self, lease: Lease) -> None:
        self.lease = weakref.ref(lease)
        self.pushed: list[torch.Tensor] = []
        self.keepers: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.ready: list[Any] = []
        self.originals: list[weakref.ref[torch.Tensor]] = []
        self.aliases: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self.via_base: set[int] | None = None
        self.grouped = False
        self.leaves = False
        self.modified: dict[int, int] = {}
        self.layout: GroupLayout | None = None
        self.layouts: list[tuple[torch.Size, tuple[int, ...], torch.dtype]] = []
        self.unique: list[torch.Tensor] = []
        self.host: list[torch.Tensor | None] = []
        self.stay: list[torch.Tensor | None] = []
        self.host_bytes = 0
        self.reloaded: list[torch.Tensor | None] = []
        self.shares: dict[int, int] | None = None
        self.pops_left: dict[int, int] | None = None
        self.in_flight: list[Any] = []
        self.push_stream: Any = None
        self.push_stream_key: Any = None
        self.reload_event: Any = None
        self.reload_waited_on: Any = NOT_WAITED

    # ------------------------------------------------------------ aliases

    def alias_of(self, tensor: torch.Tensor, ref: Any, leaf: bool) -> torch.Tensor:
        """One alias without history per tensor object (NOTE [Saved tensors without
        their history] in layer_state.py), so a tensor pushed twice is copied once
        (group processing then has work); ``ref``: a weak reference to ``tensor``
        already made, if any; ``leaf``: whether it is a leaf and no view."""
        key = id(tensor)
        entry = self.aliases.get(key)
        if entry is not None and entry[0]() is tensor:
            self.grouped = True
            return entry[1]
        alias = tensor if leaf else tensor.detach()  # a leaf: the user's, not ours to empty
        self.leaves = self.leaves or leaf
        self.aliases[key] = (ref if ref is not None else weakref.ref(tensor), alias)
        return alias

    def alias_view(self, position: int, tensor: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The view pushed at ``position``, which moves through its base: the same view
        of the base's one alias (group processing copies the base)."""
        self.grouped = True
        if self.via_base is None:
            self.via_base = set()
        self.via_base.add(position)
        base_alias = self.alias_of(base, None, base.is_leaf)  # (a base is no view)
        return base_alias.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    def drop_pushed(self) -> None:
        """Drop the device tensors as pushed, keeping their version counters: an alias
        of the layer's own becomes its keeper; the user's own tensor (a leaf) and one
        that stays on the device get a keeper of their own.  A tensor pushed twice has
        one keeper."""
        pushed = self.pushed
        if pushed and not self.keepers and not (self.grouped or self.stay or self.leaves):
            # Every alias is the layer's own detach(), no view, pushed once: its own keeper.
            empty = _no_memory(pushed[0].device)  # (all on the device they move from)
            for alias in pushed:
                alias.data = empty
            self.keepers = pushed
        elif pushed and not self.keepers:
            staying = {id(t) for t in self.stay if t is not None}
            made: dict[int, torch.Tensor] = {}
            keepers = []
            for position, tensor in enumerate(pushed):
                keeper = made.get(id(tensor))
                if keeper is None:
                    own = id(tensor) not in staying and self.originals[position]() is not tensor
                    keeper = made[id(tensor)] = version_keeper(tensor, own)
                keepers.append(keeper)
            self.keepers = keepers
        self.pushed = []

    # -------------------------------------------------------------- copies

    def to_copy(self) -> tuple[list[torch.Tensor], GroupLayout | None]:
        """The device tensors a copy out reads: one per distinct tensor, a view that moves
        through its base as that base (group processing, where it has work; otherwise
        the tensors as pushed); and the layout that undoes the grouping (None: none)."""
        if not self.grouped:
            return self.pushed, None
        group = TensorGroup(self.pushed, self.ready, via_base=self.via_base or set())
        processed = TensorGroupProcessor.process_before_offload(group)
        return processed.tensor_list, processed.aux

    def went_to_host(self, position: int) -> bool:
        """Whether the tensor pushed at ``position`` has a host copy: its copies started,
        and ``max_host_bytes`` did not keep it."""
        if not self.stay:
            return bool(self.host)
        source = self.layout.source_index[position] if self.layout is not None else position
        return self.host[source] is not None

    def copy_out(self, layer: CopyingLayer) -> None:
        """Queue the device-to-host copies of what was pushed on ``layer``'s offload
        stream (NOTE [Offload stream ordering])."""
        with _NoGrad():
            self._copy_out(layer)

    def _copy_out(self, layer: CopyingLayer) -> None:
        pushed, ready, versions, backend = self.pushed, self.ready, self.versions, layer.backend
        # A tensor modified in place since its push will never be handed back (its
        # unpack raises), but its copy must still be ordered after the modifying work.
        found = [tensor._version for tensor in pushed]
        if found != versions:
            for index, version in enumerate(found):
                if version != versions[index]:
                    self.modified[index] = version
                    ready[index] = backend.record_event()
        unique, self.layout = self.to_copy()
        self.unique = unique
        # Read once: the pool's views and the reload's tensors take these layouts.
        self.layouts = layouts = [(t.shape, t.stride(), t.dtype) for t in unique]
        sizes = [shape.numel() * dtype.itemsize for shape, _, dtype in layouts]
        pool = layer.host_buffers
        self.host = host = pool.acquire(layer.layer_index, unique, sizes, layouts)
        stream = layer.offload_stream
        if self.push_stream is not None:  # covers every tensor pushed on that stream
            backend.wait_event(stream, backend.record_event(self.push_stream))
        waited: set[int] = set()
        for event in ready:  # marked tensors, other streams, modified tensors
            if event is not None and id(event) not in waited:
                waited.add(id(event))
                backend.wait_event(stream, event)
        if pool.may_refuse and any(h is None for h in host):
            # The pool is at max_host_bytes, or the host said no: what got no buffer
            # stays on the device.
            self.stay = [t if h is None else None for h, t in zip(host, unique)]
            sizes = [n for n, h in zip(sizes, host) if h is not None]
        self.host_bytes = sum(sizes)
        hosts, sources = _with_host(self, unique)
        copy_timed(layer, "d2h", hosts, sources, self.host_bytes)
        self.in_flight = [backend.record_event(stream)]

    def copy_in(self, layer: CopyingLayer) -> None:
        """Queue the host-to-device copies back, one event for the layer."""
        if not self.host:
            self.reloaded = []
            return
        with _NoGrad():
            self._copy_in(layer)

    def _copy_in(self, layer: CopyingLayer) -> None:
        backend, stream = layer.backend, layer.offload_stream
        if backend.one_memory and not self.stay and layer.copy_timer is None:  # clone
            targets = list(map(_clone, cast(list, self.host)))
            layer.stats.count("h2d", len(targets), self.host_bytes)
        else:
            if self.stay:
                targets = [
                    backend.empty_device(host) if host is not None else cast(torch.Tensor, kept)
                    for host, kept in zip(self.host, self.stay)
                ]
            else:
                targets = backend.empty_device_many(self.layouts, cast(list, self.host))
            backend.wait_stream(stream, backend.current_stream())
            hosts, reloaded = _with_host(self, targets)
            copy_timed(layer, "h2d", reloaded, hosts, self.host_bytes)
        # One event for the layer: its first pop waits for every copy.
        event = self.reload_event = backend.record_event(stream)
        self.reload_waited_on, self.reload_stream_key = NOT_WAITED, backend.current_stream_key()
        self.in_flight = [event]
        if self.layout is None:
            reloaded = targets
        else:
            group = TensorGroup(targets, [event] * len(targets), aux=self.layout)
            reloaded = TensorGroupProcessor.process_after_reload(group).tensor_list
        self.reloaded = cast("list[torch.Tensor | None]", reloaded)
        self.pops_left = None if self.shares is None else dict(self.shares)

    def wait_for_copies(self, layer: CopyingLayer) -> None:
        """The compute stream waits for copies in flight, once (NOTE [Offload stream ordering])."""
        if self.in_flight:
            backend = layer.backend
            current = backend.current_stream()
            for event in self.in_flight:
                backend.wait_event(current, event)
            self.in_flight = []

    def release(self, layer: CopyingLayer) -> None:
        """The cycle is over: wait for copies in flight, give the host buffers back."""
        self.wait_for_copies(layer)
        layer.host_buffers.release(layer.layer_index, self.host)


def _with_host(data: LayerData, device_tensors: list[torch.Tensor]) -> tuple[list, list]:
    """The host buffers and the device tensors (one per unique tensor) of the tensors
    that have a buffer: all of them, unless the pool was at ``max_host_bytes``."""
    if not data.stay:
        return cast(list[torch.Tensor], data.host), device_tensors
    pairs = [(h, t) for h, t in zip(data.host, device_tensors) if h is not None]
    return [h for h, _ in pairs], [t for _, t in pairs]


def hand_out(data: LayerData, layer: CopyingLayer, position: int) -> torch.Tensor:
    """The reloaded tensor at ``position`` for a pop, let go of unless a shared handle
    pops it again; a position popped again in one reload gets a new copy of its host copy
    on the compute stream, or the tensor kept under ``max_host_bytes`` (NOTE [Reloaded
    tensors go one by one])."""
    tensor = data.reloaded[position]
    if tensor is not None:
        left = data.pops_left
        if left and left.get(position, 0):
            left[position] -= 1
        else:
            data.reloaded[position] = None
        return tensor
    layout = data.layout
    source = position if layout is None else layout.source_index[position]
    host = data.host[source]
    with _NoGrad():
        if host is None:
            tensor = cast(torch.Tensor, data.stay[source])
        else:
            backend = layer.backend
            tensor = backend.empty_device(host)
            backend.copy_many([tensor], [host], backend.current_stream(), layer.name)
            layer.stats.count("h2d", 1, host.nbytes)
        view = None if layout is None else layout.views[position]
        return tensor if view is None else tensor.as_strided(*view)


def copy_timed(
    layer: CopyingLayer,
    direction: str,
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    nbytes: int,
) -> None:
    """The layer's copies in one direction on the offload stream: timed, counted."""
    if not dsts:  # every tensor stayed (max_host_bytes)
        return
    stream, timer = layer.offload_stream, layer.copy_timer
    start = timer.start(stream) if timer is not None else None
    layer.backend.copy_many(dsts, srcs, stream, layer.name)
    layer.stats.count(direction, len(dsts), nbytes)
    if timer is not None:
        timer.stop(direction, nbytes, start, stream)


def pushed_bytes(data: LayerData) -> int:
    """Bytes of the tensors ``data`` pushed (a view's own, a tensor pushed twice twice)."""
    return sum(t.numel() * t.itemsize for t in data.pushed)


def count_moves(data: LayerData, saves: SaveCounts) -> None:
    """Count, after :meth:`LayerData.copy_out`, the pushed tensors that moved and those the
    host cap kept (NOTE [Counting saved tensors for nearly nothing] in step_record.py)."""
    saves.copied_bytes += data.host_bytes
    host = data.host
    saves.copied += len(host) if not data.stay else sum(h is not None for h in host)
    pushed = data.pushed
    if not data.grouped and not data.stay:  # each pushed tensor copied as it is
        saves.moved += len(pushed)
        saves.moved_bytes += data.host_bytes
        return
    sources = data.layout.source_index if data.layout is not None else range(len(pushed))
    for tensor, source in zip(pushed, sources):
        nbytes = tensor.numel() * tensor.itemsize
        if data.host[source] is None:
            saves.capped += 1
            saves.capped_bytes += nbytes
        else:
            saves.moved += 1
            saves.moved_bytes += nbytes
