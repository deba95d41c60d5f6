"""Host buffers that offloaded tensors are copied into."""

from __future__ import annotations

from collections import defaultdict

import torch

from .device import DeviceBackend
from .errors import CpuOffloadError

__all__ = ["HostBufferPool"]


Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def _layout(tensor: torch.Tensor) -> Layout:
    return tuple(tensor.shape), tensor.stride(), tensor.dtype


class HostBufferPool:
    """Hands out host buffers to layers and takes them back after backward.

    Pinned allocations are slow and may synchronize the device, so buffers are
    reused:

    * ``retain=False`` (default): a released buffer goes to a cache keyed by
      (shape, stride, dtype) and serves any later offload of that layout, so a
      steady-state training step allocates nothing.  :meth:`empty_cache` frees it.
    * ``retain=True``: the buffers of a layer are kept as a set and handed to the
      same layer of a later forward pass; its layouts must then stay the same (an
      error says which changed), as CUDA graph capture needs fixed addresses.

    Buffers are only reused after the layer released them, which happens after its
    reloads were waited for; a layer index keeps one set per forward pass in
    flight, so passes in flight never share a buffer.

    Attributes:
        allocations: host buffers allocated so far (cache misses).
    """

    def __init__(self, backend: DeviceBackend, retain: bool) -> None:
        self._backend = backend
        self.retain = retain
        self._free: defaultdict[int, list[list[torch.Tensor]]] = defaultdict(list)
        self._cache: defaultdict[Layout, list[torch.Tensor]] = defaultdict(list)
        self.allocations = 0

    def acquire(self, layer_index: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Buffers matching ``tensors`` for the layer ``layer_index``."""
        if self.retain and self._free[layer_index]:
            buffers = self._free[layer_index].pop()
            self._check_same_layout(layer_index, buffers, tensors)
            return buffers
        buffers = []
        for tensor in tensors:
            cached = None if self.retain else self._cache.get(_layout(tensor))
            if cached:
                buffers.append(cached.pop())
            else:
                self.allocations += 1
                buffers.append(self._backend.empty_host(tensor))
        return buffers

    def release(self, layer_index: int, buffers: list[torch.Tensor]) -> None:
        """Give back the buffers of ``layer_index`` once their data is no longer needed."""
        if not buffers:
            return
        if self.retain:
            self._free[layer_index].append(buffers)
            return
        for buffer in buffers:
            self._cache[_layout(buffer)].append(buffer)

    def empty_cache(self) -> None:
        """Free the buffers held for reuse."""
        self._free.clear()
        self._cache.clear()

    @staticmethod
    def _check_same_layout(
        layer_index: int, buffers: list[torch.Tensor], tensors: list[torch.Tensor]
    ) -> None:
        found = [_layout(t) for t in tensors]
        expected = [_layout(b) for b in buffers]
        if found != expected:
            raise CpuOffloadError(
                f"cpu_offload: retain_pinned_cpu_buffers=True but layer {layer_index} "
                f"saved tensors with other (shape, stride, dtype) than in the previous iteration: "
                f"expected {expected}, found {found}. Keep shapes (sequence length, batch "
                "size) fixed between iterations, or pass retain_pinned_cpu_buffers=False."
            )
