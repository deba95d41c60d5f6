"""A per-layer memory policy: keep, offload, checkpoint, or checkpoint and offload.

``offload_layers(model, policy=[...])`` applies one; ``cpu_offload.plan`` chooses one for
a memory budget.  A checkpointed layer runs its forward under non-reentrant
``torch.utils.checkpoint`` and recomputes it in backward: only its inputs stay saved.
Those inputs are saved through the saved-tensor hooks that are active when the
checkpoint starts, so a layer entered in the offload context *before* its checkpoint
offloads them (``checkpoint+offload``).  NOTE [Checkpoint inside the offload context]
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CHECKPOINT", "CHECKPOINT_OFFLOAD", "KEEP", "OFFLOAD", "POLICY_CHOICES", "check_policy"]

KEEP, OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD = (
    "keep",
    "offload",
    "checkpoint",
    "checkpoint+offload",
)
#: what a policy may say of a layer
POLICY_CHOICES = (KEEP, OFFLOAD, CHECKPOINT, CHECKPOINT_OFFLOAD)
OFFLOADED = (OFFLOAD, CHECKPOINT_OFFLOAD)
CHECKPOINTED = (CHECKPOINT, CHECKPOINT_OFFLOAD)

# NOTE [Checkpoint inside the offload context]
# Non-reentrant checkpointing saves the tensors its function receives (through the
# saved-tensor hooks active when it starts) and pushes its own hooks for everything the
# function saves, which it drops and recomputes in backward.  offload_layers enters the
# offload context in the layer's forward pre-hook, before ``forward`` runs, and the
# checkpoint is inside ``forward``: the checkpoint's inputs are the only tensors of the
# layer the offloader sees.  Recomputation calls the original forward, not the module,
# so it runs no offload hooks, and what it saves goes to the checkpoint's hooks.  The
# layer's keyword arguments are held by the checkpoint's closure, not saved: a Hugging
# Face layer's ``position_embeddings`` (shared by every layer) are not copied once per
# layer, and only positional tensors (the hidden states) are offloaded.


def check_policy(policy: object, num_layers: int, owner: str) -> list[str]:
    """``policy`` as a list, after checking it names one choice per layer and does not
    offload the last layer (its backward starts at once: there is nothing to overlap)."""
    if isinstance(policy, (str, bytes)) or not isinstance(policy, Sequence):
        raise TypeError(
            f"offload_layers: policy must be a list of {num_layers} strings from "
            f"{', '.join(POLICY_CHOICES)}, got {type(policy).__name__} {policy!r}."
        )
    policy = list(policy)
    if len(policy) != num_layers:
        raise ValueError(
            f"offload_layers: the policy has {len(policy)} entries but {num_layers} layers "
            f"were found (in {owner}); give one of {', '.join(POLICY_CHOICES)} per layer."
        )
    for index, choice in enumerate(policy):
        if choice not in POLICY_CHOICES:
            raise ValueError(
                f"offload_layers: policy[{index}] is {choice!r}; expected one of "
                f"{', '.join(POLICY_CHOICES)}."
            )
    if policy[-1] in OFFLOADED:
        raise ValueError(
            f"offload_layers: policy[{num_layers - 1}] is {policy[-1]!r}, but the last layer "
            "is never offloaded (its backward runs first: no compute to hide the copy "
            f"behind); use {KEEP!r} or {CHECKPOINT!r} for it."
        )
    return policy


def policy_runs(policy: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(first layer, last layer, choice)`` for each run of equal choices."""
    runs: list[tuple[int, int, str]] = []
    for index, choice in enumerate(policy):
        if runs and runs[-1][2] == choice:
            runs[-1] = (runs[-1][0], index, choice)
        else:
            runs.append((index, index, choice))
    return runs


class CheckpointedForward:
    """Runs a module's forward under non-reentrant activation checkpointing (as an
    instance attribute that shadows the class's ``forward``) until :meth:`remove`."""

    def __init__(self, module: nn.Module, enabled: Callable[[], bool] = lambda: True) -> None:
        self.module = module
        self.enabled = enabled  # while it says False, the forward runs as it is
        self.shadowed = module.__dict__.get("forward")  # another wrapper's, if any
        self.forward: Callable[..., Any] = module.forward
        module.forward = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self.enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)

    def remove(self) -> None:
        """Give the module its forward back (unless something wrapped ours since)."""
        if self.module.__dict__.get("forward") is not self:
            return
        if self.shadowed is None:
            del self.module.forward
        else:
            self.module.forward = self.shadowed  # type: ignore[method-assign]

    # A copy of the model carries no offloading, as the hooks (layer_hooks._LayerHook):
    # its forward is the class's, or the copied wrapper that ours shadowed.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.shadowed is not None:
            return copy.deepcopy(self.shadowed, memo)
        return _class_forward(memo.get(id(self.module), self.module))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.shadowed is not None:
            return _same, (self.shadowed,)
        return _class_forward, (self.module,)


def _class_forward(module: nn.Module) -> Any:
    return types.MethodType(type(module).forward, module)


def _same(value: Any) -> Any:
    return value


def checkpointed_modules(
    layers: Sequence[nn.Module], policy: Sequence[str], owner: str
) -> list[nn.Module]:
    """The distinct modules to checkpoint; a module found at several positions (shared
    weights) must be checkpointed at all of them or at none."""
    chosen: dict[int, bool] = {}
    for position, (layer, choice) in enumerate(zip(layers, policy, strict=True)):
        wanted = choice in CHECKPOINTED
        if chosen.setdefault(id(layer), wanted) != wanted:
            raise ValueError(
                f"offload_layers: layer {position} of {owner} is a module that also runs at "
                "another position with a different checkpointing choice; a shared module is "
                "checkpointed everywhere or nowhere: give its positions policies that agree "
                f"({CHECKPOINT!r}/{CHECKPOINT_OFFLOAD!r}, or {KEEP!r}/{OFFLOAD!r})."
            )
    unique = {id(layer): layer for layer in layers}
    return [unique[key] for key, wanted in chosen.items() if wanted]
