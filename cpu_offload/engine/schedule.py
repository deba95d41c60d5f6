"""The default schedule, written once: which layers may be offloaded, and when each is
released and reloaded.

Of ``L`` layers, ``m`` are offloaded (any layers but the last: its backward runs first,
with no compute to hide a reload behind).  The ``r``-th of them, counted from the first,
is released (its device memory dropped after its copy) at the forward of layer
``L - m + r`` and reloaded at the backward of layer ``L - 1 - m + r``; the device then
holds at most ``L - m`` layers' activations at the end of the forward pass.  The
synchronizer (``synchronizer.py``) runs this schedule; the planner's event model and its
vectorised search (``plan/``) predict it.  The formulas take numpy arrays as well as ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "check_offloaded_layers",
    "max_offloaded",
    "resolve_count",
    "offloadable",
    "release_point",
    "reload_point",
    "schedule_points",
]


def resolve_count(k: int | float, num_layers: int) -> int:
    """``offload_layers``' ``k``: ``k`` layers, or a fraction of ``num_layers`` (rounded down)."""
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise TypeError(f"offload_layers: k must be an int or a fraction, got {k!r}.")
    if isinstance(k, float):
        if not 0.0 <= k < 1.0:
            raise ValueError(
                f"offload_layers: a fractional k must be in [0, 1), got {k}; pass an int "
                f"for a number of layers (at most {num_layers - 1} of {num_layers})."
            )
        return int(k * num_layers)
    return k


def max_offloaded(model_layers: int) -> int:
    """The most layers the default schedule offloads of ``model_layers``: all but the last."""
    return model_layers - 1


def offloadable(layer: int, model_layers: int) -> bool:
    """Whether the default schedule may offload ``layer`` of ``model_layers``."""
    return 0 <= layer < max_offloaded(model_layers)


def release_point(model_layers: Any, offloaded: Any, rank: Any) -> Any:
    """The layer at whose forward the ``rank``-th of ``offloaded`` offloaded layers is
    released."""
    return model_layers - offloaded + rank


def reload_point(model_layers: Any, offloaded: Any, rank: Any) -> Any:
    """The layer at whose backward the ``rank``-th of ``offloaded`` offloaded layers
    starts its reload: the one after its release point (backward runs the other way)."""
    return release_point(model_layers, offloaded, rank) - 1


def schedule_points(model_layers: int, offloaded: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Per offloaded layer (sorted), the layers at whose forward it is released and at
    whose backward its reload starts."""
    count = len(offloaded)
    return {
        layer: (release_point(model_layers, count, rank), reload_point(model_layers, count, rank))
        for rank, layer in enumerate(offloaded)
    }


def check_offloaded_layers(layers: object, model_layers: int) -> list[int]:
    """``layers`` sorted, after checking that it names distinct layers the default
    schedule may offload (the last-layer rule included)."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(
            "cpu_offload: offloaded_layers must be a sequence of layer indices, got "
            f"{type(layers).__name__} {layers!r}."
        )
    bad = [
        layer
        for layer in layers
        if isinstance(layer, bool)
        or not isinstance(layer, int)
        or not offloadable(layer, model_layers)
    ]
    chosen = sorted(set(layers)) if not bad else []
    if bad or len(chosen) != len(layers):
        why = f"{bad[0]!r} is not one" if bad else "an index appears twice"
        raise ValueError(
            f"cpu_offload: offloaded_layers must name distinct layers in "
            f"0..{max_offloaded(model_layers) - 1} (model_layers={model_layers}; the last "
            f"layer is never offloaded): {why} in {list(layers)!r}."
        )
    return chosen
