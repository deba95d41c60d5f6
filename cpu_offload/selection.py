"""Which saved tensors are offloaded (SPEC section 3)."""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from .marks import marks_of
from .tensor_group import offloads_through_base

__all__ = ["DEFAULT_MIN_OFFLOAD_NUMEL", "is_dense", "is_offloadable", "warn_once_per_call_site"]

#: Tensors with fewer elements stay on the device: a copy this small costs more
#: in launch latency than it saves in memory (256 Ki elements, 512 KiB in bf16).
DEFAULT_MIN_OFFLOAD_NUMEL = 256 * 1024

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_warned_sites: set[tuple[str, int, str]] = set()
_warned_lock = threading.Lock()


def _user_frame() -> tuple[str, int]:
    """File and line of the innermost frame outside cpu_offload and torch."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            return filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def warn_once_per_call_site(message: str, category: type[Warning] = UserWarning) -> bool:
    """Warn at the user's call site, once per (site, message); returns whether it warned."""
    filename, lineno = _user_frame()
    key = (filename, lineno, message)
    with _warned_lock:
        if key in _warned_sites:
            return False
        _warned_sites.add(key)
    warnings.warn_explicit(message, category, filename, lineno)
    return True


def _is_traced(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor) or torch._is_functional_tensor(tensor)


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether the elements of ``tensor`` fill a block of memory exactly once.

    Contiguous tensors and permutations of them (a transposed SDPA output, say)
    are dense; such a tensor is copied with its own strides, exactly.
    """
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(tensor.shape, tensor.stride()) if s != 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def is_offloadable(tensor: object, device_type: str, min_numel: int) -> bool:
    """Whether a saved tensor is copied to the host (all rules of SPEC section 3).

    Only plain tensors qualify: parameters and views of them, fake and functional tensors of tracing
    modes and other tensor subclasses stay where they are.  Quantized tensors are
    decomposed before this check, each component checked on its own.
    """
    if type(tensor) is not torch.Tensor:
        return False
    if isinstance(tensor._base, torch.nn.Parameter):
        return False  # a view of a weight (Linear saves weight.t()) is a weight
    if tensor.device.type != device_type or tensor.numel() < min_numel:
        return False
    marks = marks_of(tensor)
    if marks is not None and marks.do_not_offload:
        return False
    if _is_traced(tensor):
        return False
    if offloads_through_base(tensor):
        if is_dense(tensor._base):
            return True
    elif is_dense(tensor):
        return True
    warn_once_per_call_site(
        f"cpu_offload: a non-contiguous saved tensor of shape {tuple(tensor.shape)} "
        f"(stride {tensor.stride()}) is not a view that can be offloaded through its "
        "base; it stays on the device. Call start_offload(t, offload_base_tensor=True) "
        "on it, or make it contiguous before it is saved, to offload it."
    )
    return False
