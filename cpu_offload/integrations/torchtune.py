"""torchtune: a drop-in for ``training.get_act_offloading_ctx_manager``.

torchtune's recipes build an activation-offloading context once and enter it around
each forward::

    self.activations_handling_ctx = training.get_act_offloading_ctx_manager(
        model, enable_activation_offloading)
    ...
    with self.activations_handling_ctx:
        logits = self._model(**batch)

:func:`get_act_offloading_ctx_manager` here has the same call and returns a context with
the same use, which offloads the first ``k`` decoder layers (``model.layers``) through
:func:`~cpu_offload.offload_layers` instead of every saved tensor.  Call it where the
recipe does: after ``set_activation_checkpointing`` (so that the hooks go on the
checkpoint wrappers) and after ``compile_model``.

Example:
    >>> import torch
    >>> from cpu_offload.integrations.torchtune import get_act_offloading_ctx_manager
    >>> model = torch.nn.Module()
    >>> model.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    >>> ctx = get_act_offloading_ctx_manager(model, True, num_offloaded_layers=2)
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> with ctx:
    ...     for layer in model.layers:
    ...         x = layer(x)
    >>> x.sum().backward()
    >>> ctx.handle.offload_synchronizer.stats.forward_passes
    1
    >>> ctx.remove()
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from ..layer_hooks import OffloadLayersHandle, find_layers, offload_layers

__all__ = ["OffloadLayersContext", "get_act_offloading_ctx_manager"]


class OffloadLayersContext:
    """Offloads the layers' activations for the forwards run inside ``with``.

    The hooks stay installed between ``with`` blocks and pass forwards outside them
    through untouched (validation, generation); the backward may run outside.

    Attributes:
        handle: the :class:`~cpu_offload.OffloadLayersHandle` of the layers.
        offload_synchronizer: its synchronizer (``.stats`` count what moved).
    """

    def __init__(self, handle: OffloadLayersHandle) -> None:
        self.handle = handle
        self.offload_synchronizer = handle.offload_synchronizer
        handle.enabled = False

    def __enter__(self) -> OffloadLayersContext:
        self.handle.enabled = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.enabled = False

    def remove(self) -> None:
        """Remove the hooks from the layers."""
        self.handle.remove()


def get_act_offloading_ctx_manager(
    model: nn.Module,
    enable_activation_offloading: bool,
    num_offloaded_layers: int | float | None = None,
    **options: Any,
) -> OffloadLayersContext | contextlib.nullcontext[None]:
    """torchtune's ``training.get_act_offloading_ctx_manager``, offloading ``k`` layers.

    Args:
        model: a torchtune ``TransformerDecoder`` (or any model
            :func:`~cpu_offload.layer_hooks.find_layers` knows).
        enable_activation_offloading: False returns a ``contextlib.nullcontext``.
        num_offloaded_layers: ``k`` layers, or a fraction of them; by default every layer
            but the last (whose activations backward needs first), the nearest to
            torchtune's offloading of everything. Fewer layers leave the copies more
            compute to hide behind.
        **options: keyword arguments of :func:`~cpu_offload.get_cpu_offload_context`.
    """
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    if num_offloaded_layers is None:
        num_offloaded_layers = len(find_layers(model)) - 1
    return OffloadLayersContext(offload_layers(model, num_offloaded_layers, **options))
