"""``offload_layers``: offload a list of modules with forward hooks, in one line."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .context import OffloadContext, get_cpu_offload_context

__all__ = ["OffloadLayersHandle", "offload_layers"]


def _primary_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a layer hands to the next one: the output itself, or its first tensor
    (tuples, lists, mappings such as Hugging Face ``ModelOutput``, dataclasses)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        items: Any = output.values()
    elif isinstance(output, (tuple, list)):
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = (getattr(output, f.name) for f in dataclasses.fields(output))
    else:
        return None
    for item in items:
        found = _primary_tensor(item)
        if found is not None:
            return found
    return None


class OffloadLayersHandle:
    """What :func:`offload_layers` returns.

    Attributes:
        context: the offload context entered around each layer.
        sync_fn: the sync function applied to each layer's output.
        offload_synchronizer: the synchronizer in use.
        controller: the manual controller with ``manual_synchronization=True``, else None.
    """

    def __init__(self, context: OffloadContext, sync_fn: Any, controller: Any) -> None:
        self.context = context
        self.sync_fn = sync_fn
        self.controller = controller
        self.offload_synchronizer = context.offload_synchronizer
        self._hooks: list[Any] = []

    def remove(self) -> None:
        """Remove the hooks: the modules behave as before."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __enter__(self) -> OffloadLayersHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def offload_layers(
    layers: Sequence[nn.Module], num_offloaded_layers: int, **options: Any
) -> OffloadLayersHandle:
    """Offload the activations of the first ``num_offloaded_layers`` of ``layers``.

    Each module's forward runs inside the offload context (forward pre- and post-hooks)
    and its output goes through ``sync_fn``, whether it returns a tensor, a tuple or a
    model-output object (the first tensor is the one passed on). Layers run in order,
    as in a decoder stack; a module may appear several times (shared weights), a
    layer may be skipped (LayerDrop), and a forward that starts over at the first
    layer (after an interrupted step) starts a new pass.

    Args:
        layers: the modules, for example a Hugging Face model's ``model.layers``.
        num_offloaded_layers: ``k``; ``0 <= k <= len(layers) - 1``.
        **options: keyword arguments of :func:`get_cpu_offload_context`
            (``retain_pinned_cpu_buffers``, ``device``, ``min_offload_numel``,
            ``manual_synchronization``, ``offload_stream``).

    Returns:
        A handle; ``handle.remove()`` restores the modules.

    Example:
        >>> import torch
        >>> from cpu_offload import offload_layers
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        >>> handle = offload_layers(layers, 2, min_offload_numel=0)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for layer in layers:
        ...     x = layer(x)
        >>> x.sum().backward()
        >>> handle.offload_synchronizer.stats.tensors_offloaded
        2
        >>> handle.remove()
    """
    layers = list(layers)
    manual = bool(options.get("manual_synchronization", False))
    result = get_cpu_offload_context(True, num_offloaded_layers, len(layers), **options)
    context, sync_fn = result[0], result[1]
    handle = OffloadLayersHandle(context, sync_fn, result[2] if manual else None)
    synchronizer = context.offload_synchronizer
    positions: dict[int, list[int]] = {}  # module id -> its positions in the list
    for position, layer in enumerate(layers):
        positions.setdefault(id(layer), []).append(position)

    def enter(module: nn.Module, args: Any) -> None:
        current = synchronizer.current_pass
        expected = current.layers_forwarded if current is not None else 0
        if expected >= len(layers):
            expected = 0
        mine = positions[id(module)]
        if expected in mine:
            context.enter_layer()
        elif mine[0] > expected:
            # Layers before this one did not run (LayerDrop, a skipped block).
            context.enter_layer(skipped=mine[0] - expected)
        else:
            # An earlier layer runs again: the forward in progress was left behind.
            context.enter_layer(skipped=mine[0], new_pass=True)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if not context.active:
            return
        exc_type, exc, traceback = sys.exc_info()
        if exc_type is not None:  # forward raised; always_call hooks run in its except
            context.__exit__(exc_type, exc, traceback)
            return
        context.__exit__(None, None, None)
        primary = _primary_tensor(output)
        if primary is not None:
            sync_fn(primary)

    for layer in {id(layer): layer for layer in layers}.values():  # a shared module once
        handle._hooks.append(layer.register_forward_pre_hook(enter))
        handle._hooks.append(layer.register_forward_hook(leave, always_call=True))
    return handle
