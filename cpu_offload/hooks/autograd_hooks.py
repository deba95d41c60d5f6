"""What the offloader asks of autograd's hook machinery, in one place.

The offload contexts push saved-tensor hooks around a layer (or a whole forward), leave
the hooks of activation checkpointing alone, pass through forwards that are no new
forward pass (checkpoint recomputation inside backward, ``torch.func`` transforms, which
refuse saved-tensor hooks), and count how many of them are active in this thread for
:func:`is_cpu_offload_enabled`.  Every call into ``torch._C`` for these lives here.

NOTE [Pushing saved-tensor hooks]
    ``torch.autograd.graph.saved_tensors_hooks`` pushes its pack/unpack pair on the
    thread's default-hooks stack when entered and pops it when left; a context manager
    object costs an allocation and two Python frames per layer, on the hooks' path.
    :func:`push_saved_tensor_hooks` and :func:`pop_saved_tensor_hooks` make the same two
    calls directly; every offload context uses them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from ..log import warn

__all__ = [
    "ActiveToken",
    "checkpoint_forward_active",
    "enter_active",
    "forward_inside_backward",
    "is_cpu_offload_enabled",
    "leave_active",
    "pop_saved_tensor_hooks",
    "push_saved_tensor_hooks",
    "saved_tensor_hooks_enabled",
    "top_pack_hook",
    "top_saved_tensor_hooks",
]

_autograd: Any = torch._C._autograd
#: push a (pack, unpack) pair of saved-tensor hooks (NOTE [Pushing saved-tensor hooks])
push_saved_tensor_hooks: Callable[[Callable[[Any], Any], Callable[[Any], Any]], None] = (
    _autograd._push_saved_tensors_default_hooks
)
#: pop the pair pushed last
pop_saved_tensor_hooks: Callable[[], None] = _autograd._pop_saved_tensors_default_hooks

# How many offload contexts are active in this thread (or asyncio task).
_active_depth: contextvars.ContextVar[int] = contextvars.ContextVar(
    "cpu_offload_active_depth", default=0
)
ActiveToken = contextvars.Token
#: warnings given once per process
_warned: set[str] = set()


def top_saved_tensor_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The ``(pack, unpack)`` pair of the innermost saved-tensor hooks of this thread, if any."""
    return _autograd._top_saved_tensors_default_hooks(False)  # type: ignore[no-any-return]


def top_pack_hook() -> Callable[[Any], Any] | None:
    """The pack hook of the innermost saved-tensor hooks of this thread, if any."""
    top = top_saved_tensor_hooks()
    return None if top is None else top[0]


def saved_tensor_hooks_enabled() -> bool:
    """False under torch.func transforms, which refuse saved-tensor hooks; warns once."""
    if _autograd._saved_tensors_hooks_is_enabled():
        return True
    if "hooks disabled" not in _warned:
        _warned.add("hooks disabled")
        warn(
            "cpu_offload: saved-tensor hooks are disabled here (torch.func transforms such "
            "as torch.func.grad disable them), so these layers run without offloading. "
            "This warning is shown once.",
            stacklevel=4,
        )
    return False


def forward_inside_backward() -> bool:
    """Whether a forward runs inside a backward pass (activation checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


def checkpoint_forward_active() -> bool:
    """Whether torch.utils.checkpoint's saved-tensor hooks are the innermost ones now.

    A layer whose offload hooks sit inside a checkpointed region must leave them
    alone: the checkpoint saves nothing and recomputes in backward.
    """
    pack = top_pack_hook()
    return pack is not None and getattr(pack, "__module__", None) == "torch.utils.checkpoint"


def enter_active() -> ActiveToken[int]:
    """An offload context becomes active in this thread; returns what :func:`leave_active`
    takes."""
    return _active_depth.set(_active_depth.get() + 1)


def leave_active(token: ActiveToken[int]) -> None:
    """The context that :func:`enter_active` gave ``token`` is left."""
    _active_depth.reset(token)


def is_cpu_offload_enabled() -> bool:
    """Whether the calling thread is inside an active offload context."""
    return _active_depth.get() > 0
