"""The two-method protocol of objects that decompose themselves for saving.

A tensor subclass that exposes ``prepare_for_saving() -> (list[Tensor | None], obj)`` and
``obj.restore_from_saved(list)`` (the quantized tensors of ``quantized/``, and
TransformerEngine's) is saved as its components: each is pushed by the offloader's
rules, and the unpack rebuilds the object from them.  The offloader never looks further
into a quantized format than these two methods.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["decompose", "has_saving_protocol"]


def has_saving_protocol(obj: object) -> bool:
    """Whether ``obj`` decomposes itself for saving (``prepare_for_saving``)."""
    return callable(getattr(obj, "prepare_for_saving", None))


def decompose(obj: Any) -> tuple[list[torch.Tensor | None], Any]:
    """``obj``'s components and the emptied object that ``restore_from_saved`` refills
    (a tensor is detached first, as autograd saves it)."""
    saved: Any = obj.detach() if isinstance(obj, torch.Tensor) else obj
    return saved.prepare_for_saving()
