"""Per-tensor marks set by the user, kept in weak side tables.

Nothing is ever written onto a user's tensor: ``mark_not_offload`` and
``start_offload`` record their facts here, keyed weakly, so a mark disappears with
what it marks.  "Do not offload" marks the tensor's storage, so that every view of
a marked tensor (``mask.view(...)``, ``mask.t()``) stays on the device too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "TensorMarks",
    "is_marked_not_offload",
    "mark_storage_not_offload",
    "marks_of",
    "marked_storages",
    "marked_tensors",
    "set_mark",
]


@dataclass
class TensorMarks:
    """What the user said about one tensor.

    Attributes:
        do_not_offload: set by ``mark_not_offload`` (also for tensors without a storage).
        ready_event: event recorded by ``start_offload`` (copy may start after it).
        offload_base: set by ``start_offload(..., offload_base_tensor=True)``.
    """

    do_not_offload: bool = False
    ready_event: Any = None
    offload_base: bool = False


_table = WeakTensorKeyDictionary()
#: the table's dictionary: empty while no tensor is marked (a check without a call)
marked_tensors = _table.data
_lock = threading.Lock()
# Storages marked "do not offload", by storage pointer.  A weak reference keeps the
# storage's control block, so a pointer cannot be reused while its entry exists.
_not_offloaded: dict[int, StorageWeakRef] = {}
#: the same dictionary: empty while no storage is marked (a check without a call)
marked_storages = _not_offloaded


def marks_of(tensor: torch.Tensor) -> TensorMarks | None:
    """The marks of ``tensor``, or ``None`` when it has none."""
    if not marked_tensors:  # the common case; a lookup would build a weak reference
        return None
    return _table.get(tensor)


def set_mark(tensor: torch.Tensor, **fields: Any) -> None:
    """Set fields of the marks of ``tensor``."""
    with _lock:
        marks = _table.get(tensor)
        if marks is None:
            marks = TensorMarks()
            _table[tensor] = marks
        for name, value in fields.items():
            setattr(marks, name, value)


def _storage_pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested, wrapper subclasses: no single storage


def mark_storage_not_offload(tensor: torch.Tensor) -> None:
    """Keep every tensor that shares ``tensor``'s storage on the device."""
    set_mark(tensor, do_not_offload=True)
    pointer = _storage_pointer(tensor)
    if pointer is None:
        return
    with _lock:
        for key in [key for key, ref in _not_offloaded.items() if ref.expired()]:
            del _not_offloaded[key]
        if pointer not in _not_offloaded:
            _not_offloaded[pointer] = StorageWeakRef(tensor.untyped_storage())


def is_marked_not_offload(tensor: torch.Tensor, marks: TensorMarks | None) -> bool:
    """Whether ``tensor`` (or a tensor sharing its storage) was passed to ``mark_not_offload``."""
    if marks is not None and marks.do_not_offload:
        return True
    if not _not_offloaded:
        return False
    pointer = _storage_pointer(tensor)
    ref = _not_offloaded.get(pointer) if pointer is not None else None
    return ref is not None and not ref.expired()
