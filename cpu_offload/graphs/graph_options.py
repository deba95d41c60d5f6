"""What ``cuda_graph=`` accepts, and the options it refuses.

NOTE [Graph shapes]
    A CUDA graph replays what was captured, without Python: every copy, event wait and
    host buffer of the offloader must be decided at capture and finish in the graph
    that started it.  Two shapes of capture are supported:

    * ``cuda_graph=True`` (``"step"``): one graph holds a whole step, the forward and
      backward of every layer (``torch.cuda.graph`` around the step, TransformerEngine's
      recipe, Megatron's full-iteration graphs).  The schedule is the eager one: a layer's
      copies overlap the next layers' compute, and every copy is joined by the end of
      the backward.
    * ``cuda_graph="layer"``: each layer's forward and each layer's backward is a graph
      of its own (``torch.cuda.make_graphed_callables`` per layer, Megatron's per-layer
      graphs).  A layer's offload starts and is joined at the end of its forward, its
      reload starts and is joined in its backward: the copies do not overlap other
      layers' compute (no graph may leave a copy for another to finish).

    Outside a capture either mode runs as eager (warm-up steps, evaluation), with the
    host buffers kept per layer, fixed, for the graph's life.  What decides per step
    outside the copies (passes moved whole, reloads in slices, a manual controller) is
    refused with ``cuda_graph``, and so is a memory budget (its policy changes after a
    measured step; the planner's options refuse it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GRAPH_SCOPES", "check_cuda_graph"]

#: what each accepted value of ``cuda_graph`` means
GRAPH_SCOPES = {True: "step", "step": "step", "layer": "layer"}


def check_cuda_graph(value: Any, api: str, **options: Any) -> str | None:
    """The graph shape ``cuda_graph`` names (``"step"``, ``"layer"``), None when off;
    ``options``: those given with it, each refused where set (not None, not False, not
    empty).

    Raises:
        TypeError: ``cuda_graph`` is not a bool, ``"step"`` or ``"layer"``.
        ValueError: an option that decides per step is given with it.
    """
    if value is False or type(value).__name__ == "bool_" and not value:
        return None
    scope = GRAPH_SCOPES.get(value) if isinstance(value, (bool, str)) else None
    if scope is None:
        raise TypeError(
            f"cpu_offload: {api}: cuda_graph must be False, True (a whole step in one "
            f"graph), 'step' (the same) or 'layer' (one graph per layer's forward and "
            f"backward); got {type(value).__name__} {value!r}."
        )
    given = [name for name, option in options.items() if option not in (None, False, ())]
    if given:
        raise ValueError(
            f"cpu_offload: {api}: {given[0]}= decides per step in Python, which a CUDA "
            f"graph's replay does not run, so it does not combine with cuda_graph="
            f"{value!r}. Leave it out (NOTE [Graph shapes] in graphs/graph_options.py)."
        )
    return scope
