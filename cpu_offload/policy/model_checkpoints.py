"""Checkpoints the model places itself, measured: what a checkpointed layer's recompute
holds in its backward (``offload_layers(model, memory_budget=...)``).

NOTE [A checkpoint the model placed]
    transformers' ``gradient_checkpointing_enable()`` checkpoints each layer's ``forward``
    inside the layer's call, through the layer's ``_gradient_checkpointing_func``: the
    offloader's hooks stay outside, and a measured layer saves only the checkpoint's
    inputs.  Its backward, though, recomputes the forward and holds everything the
    forward would have saved until the layer's backward is over: the planner must count
    that, as it counts the recompute of the layers it checkpoints itself.  So, while a
    layer is measured, the function the checkpoint runs is run under a pair of
    saved-tensor hooks that note each tensor saved (then hand it to the checkpoint's own
    hooks, which are the innermost ones there: what the checkpoint saves, and so the
    gradients, are unchanged).  The noted tensors are held until the layer's forward
    ends, so that no storage is freed and its address taken by another before they are
    counted: for that layer's forward the device holds what its recompute will hold in
    backward.  Their storages, less what the layer itself saved (the checkpoint's
    inputs) and its parameters and buffers, are the layer's ``recompute_bytes``; the
    plan counts them at the layer's backward and never checkpoints the layer again.  A
    reentrant checkpoint (``use_reentrant=True``) runs its forward without grad and
    saves nothing then: its recompute is not measured (0).  A ``torch.utils.checkpoint``
    call the model makes otherwise (not through ``_gradient_checkpointing_func``) is not
    seen either.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..hooks.autograd_hooks import (
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    top_saved_tensor_hooks,
)

__all__ = ["CountedCheckpoint", "count_model_checkpoint"]

#: the attribute through which transformers' layers checkpoint their forward
FUNC = "_gradient_checkpointing_func"


def _same(value: Any) -> Any:
    return value


class CountedCheckpoint:
    """A model's checkpoint function whose checkpointed function runs, while
    ``noted()`` gives a list, under hooks that append each saved tensor to it (NOTE [A
    checkpoint the model placed])."""

    def __init__(
        self, function: Callable[..., Any], noted: Callable[[], list[torch.Tensor] | None]
    ) -> None:
        self.function = function
        self.noted = noted

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy of the model (an EMA, a reference model) gets the model's own function,
        not this wrapper and the offloader it reaches."""
        return copy.deepcopy(self.function, memo)

    def __call__(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.function(functools.partial(self._counted, run), *args, **kwargs)

    def _counted(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        noted = self.noted()
        if noted is None or not torch.is_grad_enabled():
            return run(*args, **kwargs)
        pack, unpack = top_saved_tensor_hooks() or (_same, _same)

        def counted(tensor: Any) -> Any:
            if isinstance(tensor, torch.Tensor):
                noted.append(tensor)
            return pack(tensor)

        push_saved_tensor_hooks(counted, unpack)
        try:
            return run(*args, **kwargs)
        finally:
            pop_saved_tensor_hooks()


def count_model_checkpoint(
    module: nn.Module, noted: Callable[[], list[torch.Tensor] | None]
) -> Callable[[], None] | None:
    """Note what the checkpoint ``module`` places on its forward saves (where it has
    one: transformers' gradient checkpointing); returns what puts its function back, or
    None (no such checkpoint, or noted already)."""
    function = module.__dict__.get(FUNC)
    if function is None or isinstance(function, CountedCheckpoint):
        return None
    setattr(module, FUNC, CountedCheckpoint(function, noted))

    def restore() -> None:
        if isinstance(module.__dict__.get(FUNC), CountedCheckpoint):
            setattr(module, FUNC, function)

    return restore
