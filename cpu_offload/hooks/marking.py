"""The marking API: what users say about their tensors, recorded in the marks table.

``mark_not_offload``, ``start_offload`` and ``mark_activation_offload`` are
TransformerEngine's functions of those names; their facts live in :mod:`cpu_offload.hooks.marks`
(weak side tables, nothing written onto a user's tensor), where the pack hook reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..device.runtime import get_backend
from .marks import mark_storage_not_offload, set_mark
from .saving_protocol import decompose, has_saving_protocol

__all__ = ["mark_activation_offload", "mark_not_offload", "start_offload"]


def _components(tensors: tuple[Any, ...]) -> list[torch.Tensor]:
    """Plain tensors of the arguments; quantized objects contribute their components."""
    found: list[torch.Tensor] = []
    for tensor in tensors:
        if tensor is None:
            continue
        if has_saving_protocol(tensor):
            components, obj = decompose(tensor)
            found.extend(c for c in components if c is not None)
            obj.restore_from_saved(components)
        elif isinstance(tensor, torch.Tensor):
            found.append(tensor)
        else:
            raise TypeError(f"cpu_offload: expected tensors, got {type(tensor).__name__}.")
    return found


def mark_not_offload(*tensors: Any) -> None:
    """Keep these tensors on the device whenever they are saved for backward.

    The mark is on the storage: views of a marked tensor (``mask.view(...)``,
    ``mask.t()``) stay on the device too.  Quantized tensors (objects with
    ``prepare_for_saving``) are marked component by component.

    Example:
        >>> import torch
        >>> from cpu_offload import mark_not_offload
        >>> mask = torch.ones(1024, 1024)
        >>> mark_not_offload(mask)
    """
    for tensor in _components(tensors):
        mark_storage_not_offload(tensor)


def start_offload(*tensors: Any, offload_base_tensor: bool = False) -> None:
    """Record, on the current stream, that these tensors are ready to be copied.

    By default a saved tensor's copy waits for an event recorded when autograd
    saved it; calling this earlier lets the copy start as soon as the tensor is
    computed.  With ``offload_base_tensor=True`` a view is offloaded through its
    base (for example ``q``, ``k``, ``v`` views of one ``qkv`` tensor are copied as
    one tensor and come back as views with their strides).

    Example:
        >>> import torch
        >>> from cpu_offload import start_offload
        >>> qkv = torch.randn(4, 8, 3 * 64)
        >>> q, k, v = qkv.chunk(3, dim=-1)
        >>> start_offload(q, k, v, offload_base_tensor=True)
    """
    if torch.compiler.is_compiling():
        # Marks on the tracer's tensors never reach the tensors the compiled graph
        # saves; the warning about views says so when it fires.
        return
    # The backend of the active synchronizer is not known here; record on the
    # backend of each tensor's device.
    backends: dict[torch.device, Any] = {}
    for tensor in _components(tensors):
        fields: dict[str, Any] = {}
        if tensor.device.type != "meta":  # a meta tensor (planning) has no stream
            backend = backends.get(tensor.device)
            if backend is None:
                backend = backends[tensor.device] = get_backend(tensor.device)
            fields["ready_event"] = backend.record_event()
        if offload_base_tensor and tensor._base is not None:
            fields["offload_base"] = True
        set_mark(tensor, **fields)


def mark_activation_offload(*tensors: Any) -> None:
    """Accepted for compatibility with older callers; has no effect."""
