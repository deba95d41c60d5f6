"""Lightning: offload a ``LightningModule``'s layers from the hook that runs after the move.

:func:`~cpu_offload.offload_layers` works in any of a ``LightningModule``'s hooks, but
``setup`` and ``configure_model`` run before the Trainer moves the module to its device
(and converts it to its precision): ``offload_layers`` marks the module's buffers (RoPE
caches, masks) to stay on the device, and a mark is on a storage, so the moved buffers
would not carry it.  ``on_fit_start`` runs after the move.  :class:`OffloadLayers`, a
``Callback``, installs the hooks there and removes them when fitting ends::

    trainer = lightning.Trainer(callbacks=[OffloadLayers(0.5)])
    trainer.fit(module, data)

``OffloadLayers()`` without ``k`` or a budget installs nothing: it marks the buffers of a
module whose hooks were installed in ``setup`` or ``configure_model`` again, after the
move.

Importing this module imports Lightning (``lightning.pytorch``, or the older
``pytorch_lightning``) where it is installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..hooks.marking import mark_not_offload
from ..layer_hooks import OffloadLayersHandle, offload_layers
from ..report.stats import OffloadStats

__all__ = ["OffloadLayers"]


def _callback_base() -> Any:
    """Lightning's ``Callback`` (its package before the rename too), else ``object``: this
    module imports without Lightning, and :class:`OffloadLayers` says what is missing."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(package).Callback
        except ImportError:
            continue
    return object


_Callback: Any = _callback_base()


class OffloadLayers(_Callback):
    """A Lightning ``Callback`` that offloads the first ``k`` layers of the module while it
    fits, from ``on_fit_start`` (after the move to the device) to ``on_fit_end``.

    Args:
        num_offloaded_layers: ``k``, a number of layers or a fraction in ``[0, 1)`` of
            them, as for :func:`~cpu_offload.offload_layers`.
        memory_budget: instead of ``k``: bytes, a string such as ``"20GiB"``, or
            ``"auto"``; the first step is measured and the policy chosen from the second.
        **options: keyword arguments of :func:`~cpu_offload.offload_layers`.

    With neither ``k`` nor a budget it installs nothing and marks the module's buffers
    again in ``on_fit_start``, for hooks installed in ``setup`` or ``configure_model``.

    Attributes:
        handle: the :class:`~cpu_offload.OffloadLayersHandle` while fitting, else None.
        stats: what moved in the latest fit (kept after it ends), or None.
    """

    def __init__(
        self,
        num_offloaded_layers: int | float | None = None,
        *,
        memory_budget: int | str | None = None,
        **options: Any,
    ) -> None:
        if _Callback is object:
            raise ImportError(
                "cpu_offload.integrations.lightning.OffloadLayers needs Lightning (pip "
                "install lightning); neither lightning.pytorch nor pytorch_lightning was found."
            )
        if num_offloaded_layers is not None and memory_budget is not None:
            raise TypeError(
                "OffloadLayers: pass either num_offloaded_layers (k) or memory_budget=..., "
                "not both."
            )
        if num_offloaded_layers is None and memory_budget is None and options:
            raise TypeError(
                f"OffloadLayers: options {sorted(options)} need num_offloaded_layers (k) or "
                "memory_budget=...; without them the callback installs nothing and only "
                "marks the buffers again after the move."
            )
        self.num_offloaded_layers = num_offloaded_layers
        self.memory_budget = memory_budget
        self.options = options
        self.handle: OffloadLayersHandle | None = None
        self.stats: OffloadStats | None = None

    def __repr__(self) -> str:
        if self.memory_budget is not None:
            chosen = f"memory_budget={self.memory_budget!r}"
        else:
            chosen = repr(self.num_offloaded_layers)
        options = "".join(f", {name}={value!r}" for name, value in self.options.items())
        where = f"fitting: {self.handle!r}" if self.handle is not None else "not fitting"
        return f"OffloadLayers({chosen}{options}; {where})"

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The module is on its device and in its precision now: mark what it holds there.
        mark_not_offload(*pl_module.buffers())
        self._remove()  # a fit that raised never reached on_fit_end
        if self.memory_budget is not None:
            self.handle = offload_layers(
                pl_module, memory_budget=self.memory_budget, **self.options
            )
        elif self.num_offloaded_layers is not None:
            self.handle = offload_layers(pl_module, self.num_offloaded_layers, **self.options)
        if self.handle is not None:
            self.stats = self.handle.offload_synchronizer.stats

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
