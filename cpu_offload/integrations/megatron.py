"""Megatron-Core: install cpu-offload where Megatron looks for TransformerEngine's offloader.

Megatron-Core's ``TransformerBlock`` does not call TransformerEngine directly: it calls
``get_cpu_offload_context`` from ``megatron.core.extensions.transformer_engine`` (a
wrapper with up to seven positional parameters), bound at import time into
``megatron.core.transformer.transformer_block``, and without TransformerEngine that name
is ``None`` and the block refuses ``cpu_offloading=True``.  :func:`patch` puts
:func:`get_cpu_offload_context` in both places; build the model after patching.

Example:
    >>> from cpu_offload.integrations import megatron
    >>> ctx, commit = megatron.get_cpu_offload_context(True, 1, 4, True, False, False, False)
    >>> ctx.inside_context
    False
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..context import get_cpu_offload_context as _get_cpu_offload_context
from ..log import logger, warn

__all__ = ["MegatronPatch", "get_cpu_offload_context", "patch"]

#: where Megatron-Core (0.13 to 0.19) reads the offloader from
_SITES = (
    "megatron.core.transformer.transformer_block",
    "megatron.core.extensions.transformer_engine",
)
_LAYERS_MODULE = "megatron.core.tensor_parallel.layers"
#: Megatron-Core 0.19's HybridModel stack, which never reads the offloader
_HYBRID_MODULE = "megatron.core.models.hybrid.hybrid_block"
_HYBRID_IGNORES = (
    "cpu_offload: TransformerConfig(cpu_offloading=True) does nothing for a Megatron-Core "
    "HybridModel: its HybridStack never asks for an offload context, so "
    "cpu_offload.integrations.megatron.patch() cannot reach it and nothing is offloaded. "
    "Call cpu_offload.offload_layers(model, k) on the built model instead "
    "(docs/megatron.md, HybridModel)."
)


def get_cpu_offload_context(
    enabled: bool,
    num_layers: int,
    model_layers: int,
    activation_offloading: bool = True,
    weight_offloading: bool = False,
    double_buffering: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    *,
    memory_budget: int | str | None = None,
    **options: Any,
) -> tuple[Any, Callable[[Any], Any]]:
    """Megatron-Core's wrapper signature: ``(context, commit)``.

    The positional parameters are Megatron's, in Megatron's order (releases before
    0.19 pass the first five or six); ``options`` go to
    :func:`cpu_offload.get_cpu_offload_context` (``device``, ``min_offload_numel``).
    With ``memory_budget`` (bytes, ``"20GiB"``, or ``"auto"``), ``num_layers`` is not
    used: the first step is measured and the layers to offload are chosen for the budget
    from the next (``context.offload_synchronizer.plan``; docs/planning.md).  Megatron
    runs its layers itself, so they are offloaded or kept, never recomputed here.
    """
    if memory_budget is not None and enabled and activation_offloading:
        from ..plan.auto_policy import budget_context  # the planner, when it is asked for

        context, _ = budget_context(
            model_layers,
            memory_budget,
            api="cpu_offload.integrations.megatron",
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
            **options,
        )
        commit: Callable[[Any], Any] = context.sync_fn
    else:
        context, commit = _get_cpu_offload_context(
            enabled,
            num_layers,
            model_layers,
            activation_offloading,
            weight_offloading,
            double_buffering,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
            **options,
        )
    if enabled and activation_offloading and not _megatron_has_te():
        # Megatron's linear layers read `inside_context` only to tag their input for
        # TransformerEngine, and assert TE is present when it is True.  Our offloader
        # needs no tag: tell them they are outside.
        context.report_inside_context = False
    return context, commit


def _megatron_has_te() -> bool:
    try:
        layers = importlib.import_module(_LAYERS_MODULE)
    except ImportError:
        return False
    return bool(getattr(layers, "HAVE_TE", False))


class MegatronPatch:
    """What :func:`patch` changed; :meth:`remove` takes it back.

    Patches stack: the latest patch still in place is the one Megatron sees, and
    removing the patches in any order ends with Megatron's own function.
    """

    def __init__(self, sites: list[ModuleType], function: Callable) -> None:
        self._sites = sites
        self.function = function

    def remove(self) -> None:
        if self not in _active:
            return
        _active.remove(self)
        for module in self._sites:
            installed = [p.function for p in _active if module in p._sites]
            if installed:
                module.get_cpu_offload_context = installed[-1]  # type: ignore[attr-defined]
            else:
                module.get_cpu_offload_context = _originals.pop(module)  # type: ignore[attr-defined]
        if not _active:
            for stack, init in _hybrid_inits.items():
                stack.__init__ = init  # type: ignore[misc]
            _hybrid_inits.clear()

    def __enter__(self) -> MegatronPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


#: patches in place, oldest first, and what each site held before the first of them
_active: list[MegatronPatch] = []
_originals: dict[ModuleType, Any] = {}
#: HybridStack's own __init__, while a patch wraps it to say that it ignores the switch
_hybrid_inits: dict[type, Callable] = {}


def _warn_from_hybrid_stacks() -> None:
    """While a patch is in place, a HybridStack built with ``cpu_offloading=True`` warns
    that the switch does nothing there (Megatron accepts it silently)."""
    try:
        stack = importlib.import_module(_HYBRID_MODULE).HybridStack
    except (ImportError, AttributeError):
        return  # before 0.19, or a future layout
    if stack in _hybrid_inits:
        return
    original = stack.__init__

    @functools.wraps(original)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, config, *args, **kwargs)
        if getattr(config, "cpu_offloading", False):
            warn(_HYBRID_IGNORES, UserWarning)

    _hybrid_inits[stack] = original
    stack.__init__ = __init__


def patch(**options: Any) -> MegatronPatch:
    """Make Megatron-Core's ``TransformerBlock`` offload with cpu-offload.

    Call it before the model is built (the block creates its context in
    ``__init__``); then ``cpu_offloading=True`` and ``cpu_offloading_num_layers=k`` in
    the ``TransformerConfig`` work with or without TransformerEngine.  ``options``
    (``device``, ``min_offload_numel``, ``memory_budget``: the layers to offload chosen
    for a budget from a measured first step, in place of ``k``; ``cuda_graph``: ``True``
    for Megatron's full-iteration graphs, ``"layer"`` for its per-layer graphs, NOTE
    [Graph shapes] in graphs/graph_options.py) are passed to every context created.

    Megatron's ``TransformerConfig`` still refuses ``cpu_offloading`` with pipeline
    parallelism > 1 or activation recomputation; both work with
    :func:`cpu_offload.offload_layers` on the built model instead (see docs/megatron.md).

    Megatron-Core 0.19's ``HybridModel`` never asks for the offloader: while a patch is in
    place, building one with ``cpu_offloading=True`` warns that nothing is offloaded; use
    :func:`cpu_offload.offload_layers` on it.

    Raises:
        ImportError: Megatron-Core is not installed.
    """
    try:
        block = importlib.import_module(_SITES[0])
    except ImportError as error:
        raise ImportError(
            "cpu_offload.integrations.megatron.patch() needs megatron-core "
            "(pip install megatron-core); it was not found."
        ) from error

    def function(*args: Any, **kwargs: Any) -> tuple[Any, Callable[[Any], Any]]:
        return get_cpu_offload_context(*args, **{**options, **kwargs})

    sites = []
    for name in _SITES:
        try:
            module = block if name == _SITES[0] else importlib.import_module(name)
        except ImportError:
            continue  # the TE extension fails to import in some releases without TE
        _originals.setdefault(module, getattr(module, "get_cpu_offload_context", None))
        module.get_cpu_offload_context = function  # type: ignore[attr-defined]
        sites.append(module)
    if not hasattr(block, "TransformerBlock"):  # pragma: no cover - a future layout
        warn(
            "cpu_offload: megatron.core.transformer.transformer_block has no "
            "TransformerBlock; this Megatron-Core release is not one the patch knows.",
            UserWarning,
            stacklevel=2,
        )
    _warn_from_hybrid_stacks()
    applied = MegatronPatch(sites, function)
    _active.append(applied)
    logger.info(
        "megatron.patch: get_cpu_offload_context replaced in %s (options %s)",
        ", ".join(module.__name__ for module in sites),
        options,
    )
    return applied
