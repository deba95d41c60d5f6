"""Module hooks that copies of a hooked module do not carry, and whether a module's call
is still running (after an interrupt skipped its forward hooks)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch import nn

__all__ = ["ModuleHook", "PassThrough", "call_running"]


class PassThrough:
    """What a copy of a hooked module carries in place of each of our hooks: nothing.

    See NOTE [Copies of hooked modules].
    """

    def __call__(self, *args: Any) -> None:
        return None


class ModuleHook:
    """A module hook of cpu_offload: the layers' forward hooks of :func:`offload_layers`, and
    those of the submodules ``modules=`` names.

    NOTE [Copies of hooked modules]
        ``copy.deepcopy(model)`` (an EMA or reference model) and ``torch.save(model)``
        copy a module's hook dictionaries.  Our hooks belong to the original modules
        and their handle, so a copy gets a pass-through in their place: the copy runs
        as the model did before ``offload_layers`` (nothing is offloaded, the
        original keeps offloading).  Call ``offload_layers`` on the copy to offload
        it too.
    """

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., None]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> None:
        self.function(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> PassThrough:
        return PassThrough()

    def __reduce__(self) -> tuple[type[PassThrough], tuple[()]]:
        return PassThrough, ()


_CALL_IMPL = nn.Module._call_impl.__code__


def call_running(module: nn.Module | None) -> bool:
    """Whether a call of ``module`` encloses the module call now running its pre-hook
    in this thread: a module call's frame (``nn.Module._call_impl``) for it is on the
    stack above the innermost one.  A layer called some other way (a compiled caller)
    is never found: the context it left entered is then left.

    NOTE [Interrupted layer calls]
        A ``KeyboardInterrupt`` (or another ``BaseException``) inside a layer skips its
        forward hooks, so the context stays entered; the next layer call, or
        ``remove()``, leaves it once it knows the interrupted call is no longer running.
        That is asked of the stack only then, so the handle keeps nothing of the call:
        holding its frame would hold the layer's input, and with it the failed step's
        whole graph, its host buffers and its pass.
    """
    if module is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    innermost = True  # the call whose pre-hook asks (it may call ``module`` again)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            if not innermost and frame.f_locals.get("self") is module:
                return True
            innermost = False
        frame = frame.f_back
    return False
