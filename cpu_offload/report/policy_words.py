"""A per-layer policy in words: runs of equal choices, ``"0-1 offload, 2 keep"``.

The handle of ``offload_layers``, the contexts' reprs and the planner's tables say a
schedule the same way through :func:`describe_policy`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["describe_policy", "pass_policy_words", "policy_runs"]


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


def pass_policy_words(keep_passes: int | None, in_flight: int | None = None) -> str:
    """What ``keep_passes`` does, in words: ``"keep 1 pass, others moved whole"``; with
    ``in_flight`` (the most passes a stage holds), ``"keep 1 pass, 3 of 4 moved whole"``
    or ``"keep 2 passes (all 2 in flight)"``; ``""`` for None (every pass keeps the
    per-layer policy)."""
    if keep_passes is None:
        return ""
    kept = f"keep {keep_passes} pass{'' if keep_passes == 1 else 'es'}"
    if in_flight is None:
        return f"{kept}, others moved whole"
    if in_flight <= keep_passes:
        return f"{kept} (all {in_flight} in flight)"
    return f"{kept}, {in_flight - keep_passes} of {in_flight} moved whole"
