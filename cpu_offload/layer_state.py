"""The per-layer state machine: the mechanism that copies a layer's saved tensors.

A layer state only knows how to push, offload, release, reload and pop; when to do
each is decided by a synchronizer (``synchronizer.py``).

NOTE [Offload stream ordering]
    push:    the device tensor is kept with an event on the stream that produced it
             (or the event ``start_offload`` recorded).
    offload: the offload stream waits for each tensor's event before copying it, so
             the copy never reads a tensor that compute is still writing.
    release: the compute stream waits for the offload finish event before the
             device references are dropped; the caching allocator may hand that
             memory to later compute work only after the copies have read it.
    reload:  device tensors are allocated on the compute stream, then the offload
             stream waits for the compute stream (the new memory may have been in
             use by compute work just issued), then copies.  One event per tensor.
    pop:     the compute stream waits for that tensor's reload event.
    release all: the compute stream waits for copies still in flight (an offload
             never released, reloads never popped) before dropping the tensors.
    dropped: a layer state freed with copies in flight (its graph died between
             offload and release) does the same from a finalizer, which keeps
             both ends of the copies alive until then.
"""

from __future__ import annotations

import enum
import warnings
import weakref
from typing import Any

import torch

from .copy_timer import CopyTimer
from .device import DeviceBackend
from .errors import OffloadStateError
from .host_buffers import HostBufferPool
from .marks import marks_of
from .selection import is_offloadable
from .stats import OffloadStats
from .tensor_group import TensorGroup, TensorGroupProcessor

__all__ = ["LayerState", "OffloadableLayerState", "has_saving_protocol", "unpack_saved"]


class LayerState(enum.Enum):
    """Where the saved tensors of one layer are."""

    NOT_OFFLOADED = "not_offloaded"
    OFFLOAD_STARTED = "offload_started"
    OFFLOAD_FINISHED = "offload_finished"
    RELOAD_STARTED = "reload_started"


_FIXES = {
    "push_tensor": "Tensors can be saved for a layer only before its offload starts; "
    "start the offload after the layer's forward has finished.",
    "start_offload": "Call start_offload_layer once per layer and forward pass.",
    "release_activation_forward_gpu_memory": "Call start_offload_layer(i) before "
    "release_activation_forward_gpu_memory(i), and only once.",
    "start_reload": "Call start_reload_layer(i) once, after "
    "release_activation_forward_gpu_memory(i).",
}


def _wait_for_copies(backend: DeviceBackend, events: list[Any], _ends: list[Any]) -> None:
    """Finalizer of a layer state dropped with copies in flight; see the NOTE above."""
    current = backend.current_stream()
    for event in events:
        backend.wait_event(current, event)


def has_saving_protocol(obj: object) -> bool:
    """Whether ``obj`` decomposes itself for saving (``prepare_for_saving``)."""
    return callable(getattr(obj, "prepare_for_saving", None))


class _Offloaded:
    """What the pack hook returns for an offloaded tensor: a layer and a position."""

    __slots__ = ("layer", "generation", "index")

    def __init__(self, layer: OffloadableLayerState, generation: int, index: int) -> None:
        self.layer = layer
        self.generation = generation
        self.index = index


class _Decomposed:
    """What the pack hook returns for an object saved as its components."""

    __slots__ = ("parts", "obj")

    def __init__(self, parts: list[Any], obj: Any) -> None:
        self.parts = parts
        self.obj = obj


class OffloadableLayerState:
    """Saved tensors of one layer of one forward pass, and their copies.

    Args:
        layer_index: index of the layer in the model (used in messages and for
            host buffer reuse).
        backend: the device backend.
        offload_stream: stream on which copies run.
        host_buffers: pool that hands out host buffers.
        min_offload_numel: smaller tensors stay on the device.
        stats: counters to update.
        name: how messages name this layer.
        copy_timer: records timing events around the copies (benchmarks).
    """

    def __init__(
        self,
        layer_index: int,
        backend: DeviceBackend,
        offload_stream: Any,
        host_buffers: HostBufferPool,
        min_offload_numel: int,
        stats: OffloadStats | None = None,
        name: str | None = None,
        copy_timer: CopyTimer | None = None,
    ) -> None:
        self.layer_index = layer_index
        self.name = name or f"layer {layer_index}"
        self.backend = backend
        self.offload_stream = offload_stream
        self.host_buffers = host_buffers
        self.min_offload_numel = min_offload_numel
        self.stats = stats if stats is not None else OffloadStats()
        self.copy_timer = copy_timer
        self.state = LayerState.NOT_OFFLOADED
        self.generation = 0
        self._pushed = TensorGroup()  # device tensors as pushed, one per handle
        self._unique = TensorGroup()  # after group processing, being copied
        self._host: list[torch.Tensor] = []
        self._reloaded = TensorGroup()
        self._finish_event: Any = None
        self._in_flight: weakref.finalize | None = None

    # ---------------------------------------------------------------- guards

    def _require(self, operation: str, *allowed: LayerState) -> None:
        if self.state not in allowed:
            names = ", ".join(state.name for state in allowed)
            raise OffloadStateError(
                f"cpu_offload: cannot {operation} for {self.name}: its state is "
                f"{self.state.name}, but {operation} needs one of: {names}. "
                f"{_FIXES.get(operation, '')}".rstrip()
            )

    # ------------------------------------------------------------- push / pop

    def push_tensor(self, tensor: Any) -> Any:
        """Take a tensor autograd saves; return what the pop will need."""
        self._require("push_tensor", LayerState.NOT_OFFLOADED)
        if has_saving_protocol(tensor):
            return self._push_decomposed(tensor)
        if not is_offloadable(tensor, self.backend.device_type, self.min_offload_numel):
            return tensor
        marks = marks_of(tensor)
        event = marks.ready_event if marks is not None else None
        if event is None:
            event = self.backend.record_event()
        return _Offloaded(self, self.generation, self._pushed.append(tensor, event))

    def _push_decomposed(self, tensor: Any) -> Any:
        saved = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
        components, obj = saved.prepare_for_saving()
        parts = [None if c is None else self.push_tensor(c) for c in components]
        if not any(isinstance(part, _Offloaded) for part in parts):
            # Nothing moved: keep the original object.
            obj.restore_from_saved(components)
            return tensor
        return _Decomposed(parts, obj)

    def pop_tensor(self, handle: Any) -> Any:
        """Give back what :meth:`push_tensor` took, on the device."""
        if not isinstance(handle, _Offloaded) or handle.layer is not self:
            return unpack_saved(handle)
        if handle.generation != self.generation:
            raise OffloadStateError(
                f"cpu_offload: a saved tensor of {self.name} was used after the layer's "
                "memory was released at the end of its backward. Offloaded activations "
                "serve one backward pass: do not call backward twice through the same "
                "graph (retain_graph=True), or keep this layer out of offloading."
            )
        if self.state in (LayerState.NOT_OFFLOADED, LayerState.OFFLOAD_STARTED):
            return self._pushed.tensor_list[handle.index]
        if self.state is LayerState.OFFLOAD_FINISHED:
            self._reload_on_demand()
        self.backend.wait_event(self.backend.current_stream(), self._reloaded.events[handle.index])
        tensor = self._reloaded.tensor_list[handle.index]
        self.backend.before_handoff(tensor, self.name)
        return tensor

    def _reload_on_demand(self) -> None:
        self.stats.on_demand_reloads += 1
        if self.stats.on_demand_reloads == 1:
            warnings.warn(
                f"cpu_offload: {self.name} was needed by backward before its reload was "
                "scheduled; it is reloaded now, without overlap with compute. Call the "
                "sync function on every layer's output (or start_reload_layer in manual "
                "mode) to prefetch it. This warning is shown once.",
                stacklevel=4,
            )
        self.start_reload()

    # ---------------------------------------------------------- transitions

    @torch.no_grad()  # a copy must not enter the graph: a host buffer would keep it alive
    def start_offload(self) -> None:
        """Queue device-to-host copies of the layer's tensors on the offload stream."""
        self._require("start_offload", LayerState.NOT_OFFLOADED)
        self.state = LayerState.OFFLOAD_STARTED
        if not self._pushed.tensor_list:
            return
        self._unique = TensorGroupProcessor.process_before_offload(self._pushed)
        self._host = self.host_buffers.acquire(self.layer_index, self._unique.tensor_list)
        stream = self.offload_stream
        for ready in self._unique.events:  # every copy after its tensor's ready event
            self.backend.wait_event(stream, ready)
        timer = self.copy_timer
        start = timer.start(stream) if timer is not None else None
        nbytes = 0
        for host, tensor in zip(self._host, self._unique.tensor_list):
            self.backend.copy(host, tensor, stream, self.name)
            nbytes += host.numel() * host.element_size()
        self.stats.tensors_offloaded += len(self._host)
        self.stats.bytes_offloaded += nbytes
        if timer is not None:
            timer.stop("d2h", nbytes, start, stream)
        self._finish_event = self.backend.record_event(stream)
        self._guard([self._finish_event], [*self._unique.tensor_list, *self._host])

    def release_activation_forward_gpu_memory(self) -> None:
        """Drop the device copies once the offload has read them."""
        self._require("release_activation_forward_gpu_memory", LayerState.OFFLOAD_STARTED)
        self.state = LayerState.OFFLOAD_FINISHED
        self._wait_for_offload()
        self._pushed = TensorGroup()
        self._unique = TensorGroup(aux=self._unique.aux)

    @torch.no_grad()
    def start_reload(self) -> None:
        """Queue host-to-device copies on the offload stream, one event per tensor."""
        self._require("start_reload", LayerState.OFFLOAD_FINISHED)
        self.state = LayerState.RELOAD_STARTED
        if not self._host:
            self._reloaded = TensorGroup()
            return
        backend, stream = self.backend, self.offload_stream
        targets = [backend.empty_device(host) for host in self._host]
        backend.wait_stream(stream, backend.current_stream())
        group = TensorGroup(aux=self._unique.aux)
        timer = self.copy_timer
        start = timer.start(stream) if timer is not None else None
        nbytes = 0
        for target, host in zip(targets, self._host):
            backend.copy(target, host, stream, self.name)
            group.append(target, backend.record_event(stream))
            nbytes += host.numel() * host.element_size()
        self.stats.tensors_reloaded += len(targets)
        self.stats.bytes_reloaded += nbytes
        if timer is not None:
            timer.stop("h2d", nbytes, start, stream)
        self._guard(list(group.events), [*group.tensor_list, *self._host])
        self._reloaded = TensorGroupProcessor.process_after_reload(group)

    def release_all_memory(self) -> None:
        """Drop everything after the layer's backward; back to ``NOT_OFFLOADED``.

        Allowed in every state. Saved tensors popped afterwards raise an error.
        """
        if self.state is LayerState.OFFLOAD_STARTED:
            self._wait_for_offload()
        elif self._in_flight is not None:
            # Reloads nobody popped may still be writing into the tensors we drop.
            self._in_flight()
        self.host_buffers.release(self.layer_index, self._host)
        self._pushed, self._unique, self._reloaded = TensorGroup(), TensorGroup(), TensorGroup()
        self._host = []
        self._finish_event = None
        self._in_flight = None
        self.generation += 1
        self.state = LayerState.NOT_OFFLOADED

    def _wait_for_offload(self) -> None:
        if self._in_flight is not None:
            self._in_flight()  # waits for the finish event, once
            self._in_flight = None
        self._finish_event = None

    def _guard(self, events: list[Any], ends: list[torch.Tensor]) -> None:
        """Arm the finalizer that waits for ``events`` if this state is dropped."""
        self._in_flight = weakref.finalize(self, _wait_for_copies, self.backend, events, ends)
        self._in_flight.atexit = False

    # -------------------------------------------------------------- queries

    @property
    def num_offloaded_tensors(self) -> int:
        """Distinct tensors copied (or to be copied) to the host."""
        return len(self._host)

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of this layer's data that sits in host memory now."""
        if self.state is LayerState.NOT_OFFLOADED:
            return 0.0
        return sum(t.numel() * t.element_size() for t in self._host) / 2**20


def unpack_saved(handle: Any) -> Any:
    """The unpack hook: turn whatever a pack hook returned back into a tensor."""
    if isinstance(handle, _Offloaded):
        return handle.layer.pop_tensor(handle)
    if isinstance(handle, _Decomposed):
        components = [None if part is None else unpack_saved(part) for part in handle.parts]
        handle.obj.restore_from_saved(components)
        return handle.obj
    return handle
