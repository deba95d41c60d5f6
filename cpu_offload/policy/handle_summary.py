"""How :func:`~cpu_offload.offload_layers`' handle says what it hooked: the layers found,
the policy (or ``k``, or the memory budget's plan) as runs of layers, the thresholds.
Its ``repr`` and the ``INFO`` record of ``logging.getLogger("cpu_offload")`` say this."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import nn

from ..report.policy_words import describe_policy, pass_policy_words
from .memory_budget import said_budget

__all__ = ["BudgetPolicy", "found_layers", "schedule_of"]


class BudgetPolicy(Protocol):
    """What a memory budget's chooser (``auto_policy.AutoPolicy``) shows a handle."""

    memory_budget: int | str

    @property
    def policy(self) -> list[str] | None:
        """The plan's policy in force, None while the first step is measured."""

    @property
    def why_no_plan(self) -> str:
        """Why no plan is in force (while none is); empty while the first step is measured."""


def found_layers(layers: Sequence[nn.Module], where: str, owner: str) -> str:
    """``"4 LlamaDecoderLayer at model.layers of LlamaForCausalLM"``."""
    kinds = {type(layer).__name__ for layer in layers}
    found = f"{len(layers)} {kinds.pop() if len(kinds) == 1 else 'modules'} at {where}"
    return found if where.startswith("the ") else f"{found} of {owner}"


def schedule_of(
    policy: Sequence[str] | None,
    k: int | None,
    budget: BudgetPolicy | None,
    keep_passes: int | None = None,
) -> str:
    """The handle's schedule in words: ``"layers 0-1 offload, 2-3 keep (k=2)"``, and
    ``"; keep 1 pass, others moved whole"`` with ``keep_passes``."""
    said = _layer_schedule(policy, k, budget)
    return f"{said}; {pass_policy_words(keep_passes)}" if keep_passes is not None else said


def _layer_schedule(
    policy: Sequence[str] | None, k: int | None, budget: BudgetPolicy | None
) -> str:
    if budget is not None:
        said = said_budget(budget.memory_budget)
        chosen = budget.policy
        if chosen is None:
            why = budget.why_no_plan
            if not why:
                return f"memory_budget={said}: the first step runs as the model does, measured"
            return f"memory_budget={said}: no plan yet, the model runs as it is ({why})"
        return f"memory_budget={said}: layers {describe_policy(chosen)}"
    if policy is None:
        return "a manual controller offloads"
    return f"layers {describe_policy(policy)}" + (f" (k={k})" if k is not None else "")
