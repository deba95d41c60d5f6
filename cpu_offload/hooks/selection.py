"""Which saved tensors are offloaded, and which stay where they are (and why)."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType

import torch

from ..device.backend import is_dense
from ..log import logger
from .marks import TensorMarks, is_marked_not_offload, marked_storages, marks_of
from .tensor_group import AUTO_BASE_MAX_RATIO, offloads_through_base

__all__ = [
    "DEFAULT_MIN_OFFLOAD_NUMEL",
    "is_dense",
    "is_offloadable",
    "kept_because",
    "plain_kept_because",
    "warn_not_dense",
    "warn_once_per_call_site",
]

#: Tensors with fewer elements stay on the device: a copy this small costs more
#: in launch latency than it saves in memory (256 Ki elements, 512 KiB in bf16).
DEFAULT_MIN_OFFLOAD_NUMEL = 256 * 1024

_PACKAGE_DIR = os.path.abspath(__file__)
for _ in range(__name__.count(".")):  # up to the package's root, wherever this module lies
    _PACKAGE_DIR = os.path.dirname(_PACKAGE_DIR)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_warned_sites: set[tuple[str, int, str]] = set()
_warned_lock = threading.Lock()
_AOT_AUTOGRAD_DIR = os.path.join(_TORCH_DIR, "_functorch", "_aot_autograd")


def _user_frame() -> tuple[str, int]:
    """File and line of the innermost frame outside cpu_offload and torch."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            return filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def warn_once_per_call_site(
    message: str, category: type[Warning] = UserWarning, reason: str | None = None
) -> bool:
    """Warn at the user's call site, once per (site, reason); returns whether it warned.

    ``reason`` defaults to the message; pass a fixed reason when the message names
    shapes that change from step to step.
    """
    filename, lineno = _user_frame()
    key = (filename, lineno, message if reason is None else reason)
    with _warned_lock:
        if key in _warned_sites:
            return False
        _warned_sites.add(key)
    warnings.warn_explicit(message, category, filename, lineno)
    logger.warning(message)
    return True


def _saved_by_compiled_graph() -> bool:
    """Whether the tensor being packed was saved by a torch.compile'd region (a graph
    that AOTAutograd runs, or FX code that dynamo generated)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(("<eval_with_key>", _AOT_AUTOGRAD_DIR)):
            return True
        frame = frame.f_back
    return False


def _cast_node_type() -> type | None:
    """The class of autograd's node for a dtype cast (``ToCopyBackward0``), or None."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            node = torch.zeros(1, requires_grad=True).to(torch.float64).grad_fn
    except RuntimeError:  # pragma: no cover - no autograd here
        return None
    return type(node) if node is not None and node.name() == "ToCopyBackward0" else None


#: the node class of a dtype cast, known once (asking a node its name costs a call per tensor)
_CAST_NODE = _cast_node_type()
_STRIDED = torch.strided
_CPU = torch.device("cpu")
_Parameter = torch.nn.Parameter
_is_functional = torch._is_functional_tensor


def _is_cast_of_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or its base) is a dtype cast of a parameter.

    Autocast caches its casts of weights for the whole forward pass: copying them to
    the host frees no memory and costs link bandwidth, so they are treated like the
    parameters they come from.
    """
    for candidate in (tensor, tensor._base):
        grad_fn = candidate.grad_fn if candidate is not None else None
        if grad_fn is not None and grad_fn.name() == "ToCopyBackward0":
            source = grad_fn.next_functions[0][0]
            return isinstance(getattr(source, "variable", None), torch.nn.Parameter)
    return False


def is_offloadable(
    tensor: object, device: torch.device, min_numel: int, min_bytes: int = 0
) -> bool:
    """Whether a saved tensor is copied to the host.

    A tensor moves only if it is a plain strided tensor on exactly ``device`` with at
    least ``min_numel`` elements (and at least one) and ``min_bytes`` bytes, is not a
    parameter, a view of one or a dtype cast of one (autocast's cached weights), was
    not marked with
    ``mark_not_offload`` (nor a tensor sharing its storage), is not a fake or
    functional tensor of a tracing mode, carries no conjugate or negative bit, and
    is dense or a view copied through its dense base.  Everything else stays where it
    is: a tensor that cannot be moved exactly is not moved.  Quantized tensors are
    decomposed before this check.  :func:`kept_because` says why a tensor stays.
    """
    reason = kept_because(tensor, device, min_numel, min_bytes)
    if reason == NOT_DENSE:
        warn_not_dense(tensor)  # type: ignore[arg-type]
    return reason is None


#: why a saved tensor stays on the device (:func:`kept_because`)
SUBCLASS, SMALL, OTHER_DEVICE, NOT_STRIDED = "subclass", "small", "other device", "not strided"
PARAMETER, MARKED, BIT_OR_TRACING, NOT_DENSE = (
    "parameter",
    "marked",
    "conj/neg/functional",
    "not dense",
)
#: kept because ``offload_layers(..., modules=...)`` keeps what its submodule saves
KEPT_BY_MODULES = "modules= keep"


def kept_because(
    tensor: object, device: torch.device, min_numel: int, min_bytes: int = 0
) -> str | None:
    """Why :func:`is_offloadable` keeps ``tensor`` on the device; None if it moves."""
    if type(tensor) is not torch.Tensor:
        return SUBCLASS  # parameters, tensor subclasses (nested, fake, DTensor, ...)
    numel = tensor.numel()
    if numel < min_numel:
        return SMALL
    return plain_kept_because(
        tensor, numel, device, min_bytes, marks_of(tensor), tensor._base, tensor.grad_fn
    )


def plain_kept_because(
    tensor: torch.Tensor,
    numel: int,
    device: torch.device,
    min_bytes: int,
    marks: TensorMarks | None,
    base: torch.Tensor | None,
    grad_fn: object,
) -> str | None:
    """:func:`kept_because` for a ``torch.Tensor`` (exactly) of ``numel`` elements, at
    least ``min_numel``, whose marks are ``marks``, ``_base`` is ``base`` and
    ``grad_fn`` is ``grad_fn``: the pack hook's path, where every check is paid per
    saved tensor, the cheap and common ones first (each attribute read from Python
    costs a call: the caller reads ``_base`` and ``grad_fn``, which it needs too, once)."""
    if numel == 0 or (min_bytes and numel * tensor.element_size() < min_bytes):
        return SMALL
    # (``is_cpu`` reads a flag; ``device`` makes a device object to compare)
    if (not tensor.is_cpu) if device == _CPU else tensor.device != device:
        return OTHER_DEVICE
    if tensor.layout is not _STRIDED:
        return NOT_STRIDED
    # A view of a weight (Linear saves weight.t()) is a weight.  (Parameters are leaves;
    # an isinstance check against Parameter runs Python code, so it is asked last.)
    if base is not None and base.is_leaf and isinstance(base, _Parameter):
        return PARAMETER
    if (marks is not None or marked_storages) and is_marked_not_offload(tensor, marks):
        return MARKED
    if tensor.is_conj() or tensor.is_neg() or _is_functional(tensor):
        return BIT_OR_TRACING  # (fake tensors are a subclass, refused above)
    if (
        _CAST_NODE is None
        or type(grad_fn) is _CAST_NODE
        or (base is not None and type(base.grad_fn) is _CAST_NODE)
    ) and (tensor.requires_grad and _is_cast_of_parameter(tensor)):
        return PARAMETER
    if base is not None and offloads_through_base(tensor, marks):
        return None if is_dense(base) else NOT_DENSE
    return None if tensor.is_contiguous() or is_dense(tensor) else NOT_DENSE


def warn_not_dense(tensor: torch.Tensor) -> None:
    if _saved_by_compiled_graph():
        advice = (
            "It was saved by a torch.compile'd region, where start_offload() marks do not "
            "reach the saved tensors; make the tensor contiguous inside the region, or call "
            "start_offload on it outside the region, to offload it."
        )
    else:
        advice = (
            "Call start_offload(t, offload_base_tensor=True) on it, or make it contiguous "
            "before it is saved, to offload it."
        )
    base = tensor._base
    if base is not None and base.numel() > AUTO_BASE_MAX_RATIO * tensor.numel():
        why = (
            f"its base is {base.numel() / tensor.numel():.0f}x larger, and views are moved "
            f"through their base unasked only up to {AUTO_BASE_MAX_RATIO}x"
        )
    else:
        why = "it is not a view that can be offloaded through its base"
    warn_once_per_call_site(
        f"cpu_offload: a non-contiguous saved tensor (first seen: shape "
        f"{tuple(tensor.shape)}, stride {tensor.stride()}) stays on the device: {why}. "
        f"{advice} This warning is shown once per call site.",
        reason="not dense",
    )
