"""A per-layer policy in words: runs of equal choices, ``"0-1 offload, 2 keep"``.

The handle of ``offload_layers``, the contexts' reprs and the planner's tables say a
schedule the same way through :func:`describe_policy`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["describe_policy", "layer_ranges", "policy_runs"]


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


def layer_ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
