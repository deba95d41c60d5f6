"""A per-layer memory policy: keep, offload, checkpoint, or checkpoint and offload.

``offload_layers(model, policy=[...])`` applies one; ``cpu_offload.plan`` chooses one for
a memory budget.  A checkpointed layer runs its forward under non-reentrant
``torch.utils.checkpoint`` and recomputes it in backward: only its inputs stay saved.
Those inputs are saved through the saved-tensor hooks that are active when the
checkpoint starts, so a layer entered in the offload context *before* its checkpoint
offloads them (``checkpoint+offload``): NOTE [Checkpoint inside the offload context] in
checkpointing.py, which holds the wrapper.  :func:`checkpoint_hazards` says which layers a
recompute would change, and which automatic choices must not checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..engine.schedule import offloadable
from ..log import warn

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_OFFLOAD",
    "KEEP",
    "OFFLOAD",
    "POLICY_CHOICES",
    "check_policy",
    "checkpoint_hazards",
    "describe_policy",
]

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
    for index, choice in enumerate(policy):
        if choice in OFFLOADED and not offloadable(index, num_layers):
            raise ValueError(
                f"offload_layers: policy[{index}] is {choice!r}, but the last layer is never "
                "offloaded (its backward runs first: no compute to hide the copy behind); "
                f"use {KEEP!r} or {CHECKPOINT!r} for it."
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


def describe_policy(policy: Sequence[str]) -> str:
    """``["offload", "offload", "keep"]`` as ``"0-1 offload, 2 keep"``."""
    return ", ".join(
        f"{first} {choice}" if first == last else f"{first}-{last} {choice}"
        for first, last, choice in policy_runs(policy)
    )


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


def checkpoint_hazards(module: nn.Module) -> list[str]:
    """Why recomputing ``module``'s forward in backward changes training: one sentence
    per cause found, empty when none is.

    ``torch.utils.checkpoint`` runs a checkpointed layer's forward twice.  It restores the
    default random generators for the recompute (dropout draws the same masks), but not
    the rest of what a forward changes:

    - a normalization layer that tracks running statistics (``BatchNorm``,
      ``SyncBatchNorm``, ``InstanceNorm(track_running_stats=True)``) updates them again
      in training mode;
    - a module that draws from a ``torch.Generator`` of its own (an attribute) draws other
      numbers in the recompute than in the forward.

    ``offload_layers(policy=...)`` warns when it checkpoints such a layer, and the planner
    (:func:`cpu_offload.plan.measure_layer` records them) does not choose checkpointing
    for it.  Side effects found elsewhere (a generator in a closure, a counter) are not
    seen.

    Example:
        >>> import torch
        >>> from cpu_offload.policy.policy import checkpoint_hazards
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        >>> checkpoint_hazards(block)  # doctest: +NORMALIZE_WHITESPACE
        ['1 (BatchNorm1d) updates its running statistics in training mode, and again in
        the recompute (eval() or track_running_stats=False avoid it)']
        >>> checkpoint_hazards(torch.nn.Linear(8, 8))
        []
    """
    hazards = []
    for name, sub in module.named_modules():
        where = f"{name or 'the layer'} ({type(sub).__name__})"
        if isinstance(sub, _NormBase) and sub.track_running_stats:
            hazards.append(
                f"{where} updates its running statistics in training mode, and again in "
                "the recompute (eval() or track_running_stats=False avoid it)"
            )
        for attribute in _generators(sub):
            hazards.append(
                f"{where} draws from its own torch.Generator ({attribute}), which "
                "checkpointing does not restore: the recompute draws other numbers (draw "
                "from the default generator, which it restores)"
            )
    return hazards


def _generators(module: nn.Module) -> list[str]:
    """The attributes of ``module`` (or their items) that are ``torch.Generator`` s."""
    found = []
    for attribute, value in vars(module).items():
        if isinstance(value, torch.Generator):
            found.append(attribute)
        elif isinstance(value, (list, tuple, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            found += [
                f"{attribute}[{key!r}]" for key, item in items if isinstance(item, torch.Generator)
            ]
    return found


def warn_checkpoint_hazards(layers: Sequence[nn.Module], policy: Sequence[str]) -> None:
    """One warning naming every layer ``policy`` checkpoints whose recompute changes
    training (:func:`checkpoint_hazards`), and what to do."""
    seen: set[int] = set()
    found = []
    for position, (layer, choice) in enumerate(zip(layers, policy, strict=True)):
        if choice in CHECKPOINTED and id(layer) not in seen:
            seen.add(id(layer))
            found += [
                f"layer {position} ({type(layer).__name__}): {hazard}"
                for hazard in checkpoint_hazards(layer)
            ]
    if found:
        warn(
            "cpu_offload: offload_layers checkpoints layers whose forward, run again in "
            "backward, changes training: " + "; ".join(found) + f". Give these layers "
            f"{KEEP!r} or {OFFLOAD!r} instead (the planner does not checkpoint them), or "
            "remove the cause.",
            UserWarning,
            stacklevel=3,
        )
