"""Host buffers that offloaded tensors are copied into."""

from __future__ import annotations

from collections import defaultdict

import torch

from .device import DeviceBackend
from .errors import CpuOffloadError

__all__ = ["HostBufferPool"]


class HostBufferPool:
    """Hands out host buffers to layers and takes them back after backward.

    With ``retain=False`` every offload allocates fresh buffers, and buffers are
    dropped when the layer releases them.  With ``retain=True`` the buffers of a
    layer are kept after its backward and handed to the same layer of a later
    forward pass; shapes and dtypes must then stay the same.  A layer index keeps
    one set of buffers per forward pass in flight at once, so a pipeline schedule
    with several passes in flight never shares a buffer between them.
    """

    def __init__(self, backend: DeviceBackend, retain: bool) -> None:
        self._backend = backend
        self.retain = retain
        self._free: defaultdict[int, list[list[torch.Tensor]]] = defaultdict(list)
        self.allocations = 0

    def acquire(self, layer_index: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Buffers matching ``tensors`` for the layer ``layer_index``."""
        if self.retain and self._free[layer_index]:
            buffers = self._free[layer_index].pop()
            self._check_same_layout(layer_index, buffers, tensors)
            return buffers
        self.allocations += len(tensors)
        return [self._backend.empty_host(tensor) for tensor in tensors]

    def release(self, layer_index: int, buffers: list[torch.Tensor]) -> None:
        """Give back the buffers of ``layer_index`` (kept only when retaining)."""
        if self.retain and buffers:
            self._free[layer_index].append(buffers)

    @staticmethod
    def _check_same_layout(
        layer_index: int, buffers: list[torch.Tensor], tensors: list[torch.Tensor]
    ) -> None:
        found = [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]
        expected = [(tuple(b.shape), b.stride(), b.dtype) for b in buffers]
        if found != expected:
            raise CpuOffloadError(
                f"cpu_offload: retain_pinned_cpu_buffers=True but layer {layer_index} "
                f"saved tensors with other (shape, stride, dtype) than in the previous iteration: "
                f"expected {expected}, found {found}. Keep shapes (sequence length, batch "
                "size) fixed between iterations, or pass retain_pinned_cpu_buffers=False."
            )
