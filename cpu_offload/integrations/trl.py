"""TRL: a drop-in for ``trl.models.get_act_offloading_ctx_manager``, and :func:`patch`.

TRL's SFT, DPO, KTO and Reward trainers build their activation-offloading context once,
with ``get_act_offloading_ctx_manager(model=self.model)`` (no threshold), and enter it
around each ``training_step``.  :func:`get_act_offloading_ctx_manager` here takes TRL's
parameters in TRL's order with TRL's defaults: saved tensors of 1,024 bytes and more
move, as TRL's own call moves them, but by layer (the decoder layers but the last,
through :func:`~cpu_offload.offload_layers`), on any device, a CPU-only machine included
(TRL's own asks ``torch.accelerator`` for a device and fails where there is none).

:func:`patch` puts it where the trainers look for TRL's, so that
``SFTConfig(activation_offloading=True)`` runs cpu-offload; build the trainer after it::

    from cpu_offload.integrations import trl as offload_trl

    with offload_trl.patch():
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(
            ..., activation_offloading=True), train_dataset=data)
        trainer.train()

:class:`OffloadActivations` is TRL's class of that name (whole forward, no layer list),
with TRL's defaults.  Importing this module does not import TRL; :func:`patch` does.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

from torch import nn

from ..log import logger
from . import torchtune
from .torchtune import OffloadLayersContext

__all__ = ["OffloadActivations", "TrlPatch", "get_act_offloading_ctx_manager", "patch"]

#: TRL's default threshold, in bytes (``min_offload_size``), for both its entry points
TRL_MIN_OFFLOAD_SIZE = 1024

#: the modules that bind TRL's function at import (TRL 0.19 to 1.16)
_SITES = (
    "trl.models",
    "trl.models.activation_offloading",
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.kto_trainer",
    "trl.trainer.reward_trainer",
)


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = TRL_MIN_OFFLOAD_SIZE,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
    *,
    num_offloaded_layers: int | float | None = None,
    memory_budget: int | str | None = None,
    **options: Any,
) -> OffloadLayersContext | contextlib.nullcontext[None]:
    """TRL's ``get_act_offloading_ctx_manager``: TRL's parameters, order and defaults.

    Args:
        model: the model TRL's trainer holds (a transformers or peft model, or any
            model :func:`~cpu_offload.policy.layer_discovery.find_layers` knows).
        use_pin_memory, use_streams, max_fwd_stash_size, warn_if_no_head: TRL's,
            accepted (see :class:`OffloadActivations`; the output head is never a
            decoder layer, so it is never offloaded).
        min_offload_size: saved tensors of fewer bytes stay on the device (TRL's 1,024
            by default), mapped to ``min_offload_bytes`` with ``min_offload_numel=0``
            unless that is given.
        num_offloaded_layers: ``k`` layers, or a fraction of them; by default every
            layer but the last.
        memory_budget: instead of ``k``: the layers chosen for a budget from a measured
            first step (docs/planning.md).
        **options: keyword arguments of :func:`~cpu_offload.get_cpu_offload_context`.

    Example:
        >>> import torch
        >>> from cpu_offload.integrations.trl import get_act_offloading_ctx_manager
        >>> model = torch.nn.Module()
        >>> model.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        >>> ctx = get_act_offloading_ctx_manager(model=model)
        >>> x = torch.randn(32, 16, requires_grad=True)  # 2,048 bytes a tensor
        >>> with ctx:
        ...     for layer in model.layers:
        ...         x = layer(x)
        ...     x.sum().backward()
        >>> ctx.offload_synchronizer.stats.bytes_offloaded
        4096
        >>> ctx.remove()
    """
    return torchtune.get_act_offloading_ctx_manager(
        model,
        True,
        num_offloaded_layers,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        warn_if_no_head=warn_if_no_head,
        memory_budget=memory_budget,
        **options,
    )


class OffloadActivations(torchtune.OffloadActivations):
    """TRL's ``OffloadActivations``: TRL's positional order (``min_offload_size`` third,
    before ``max_fwd_stash_size``: torchtune's order is the other way round) and defaults.

    Everything else is :class:`cpu_offload.integrations.torchtune.OffloadActivations`.

    Example:
        >>> import torch
        >>> from cpu_offload.integrations.trl import OffloadActivations
        >>> ctx = OffloadActivations(True, True, 4096)  # tensors of 4 KiB and more move
        >>> ctx.offload_synchronizer.thresholds()
        'min_offload_numel=0, min_offload_bytes=4096, max_host_bytes=None'
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = TRL_MIN_OFFLOAD_SIZE,
        max_fwd_stash_size: int = 5,
        **options: Any,
    ) -> None:
        super().__init__(
            use_pin_memory, use_streams, max_fwd_stash_size, min_offload_size, **options
        )


class TrlPatch:
    """What :func:`patch` changed; :meth:`remove` (or leaving ``with``) puts TRL's back."""

    def __init__(self, replaced: list[tuple[ModuleType, Any]]) -> None:
        self._replaced = replaced

    def remove(self) -> None:
        for module, original in reversed(self._replaced):
            module.get_act_offloading_ctx_manager = original  # type: ignore[attr-defined]
        self._replaced.clear()

    def __enter__(self) -> TrlPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def patch(**options: Any) -> TrlPatch:
    """Make TRL's trainers (``activation_offloading=True``) offload with cpu-offload.

    Replaces ``get_act_offloading_ctx_manager`` in the TRL modules that bound it; build
    the trainer after patching (it builds its context in ``__init__``).  ``options`` (for
    example ``num_offloaded_layers``, ``memory_budget``, ``min_offload_size``) go to
    every call of :func:`get_act_offloading_ctx_manager`; the trainer's own keywords win.

    Raises:
        ImportError: TRL is not installed.
    """
    try:
        importlib.import_module(_SITES[0])
    except ImportError as error:
        raise ImportError(
            "cpu_offload.integrations.trl.patch() needs TRL (pip install trl); it was not found."
        ) from error

    def function(*args: Any, **kwargs: Any) -> Any:
        return get_act_offloading_ctx_manager(*args, **{**options, **kwargs})

    replaced = []
    for name in _SITES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a trainer this release does not have, or cannot import
            continue
        if hasattr(module, "get_act_offloading_ctx_manager"):
            replaced.append((module, module.get_act_offloading_ctx_manager))
            module.get_act_offloading_ctx_manager = function  # type: ignore[attr-defined]
    logger.info(
        "trl.patch: get_act_offloading_ctx_manager replaced in %s (options %s)",
        ", ".join(module.__name__ for module, _ in replaced),
        options,
    )
    return TrlPatch(replaced)
