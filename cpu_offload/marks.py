"""Per-tensor marks set by the user, kept in a weak side table.

Nothing is ever written onto a user's tensor: ``mark_not_offload`` and
``start_offload`` record their facts here, keyed weakly by the tensor, so a mark
disappears with its tensor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["TensorMarks", "marks_of", "set_mark"]


@dataclass
class TensorMarks:
    """What the user said about one tensor.

    Attributes:
        do_not_offload: set by ``mark_not_offload``.
        ready_event: event recorded by ``start_offload`` (copy may start after it).
        offload_base: set by ``start_offload(..., offload_base_tensor=True)``.
    """

    do_not_offload: bool = False
    ready_event: Any = None
    offload_base: bool = False


_table = WeakTensorKeyDictionary()
_lock = threading.Lock()


def marks_of(tensor: torch.Tensor) -> TensorMarks | None:
    """The marks of ``tensor``, or ``None`` when it has none."""
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
