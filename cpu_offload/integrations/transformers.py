"""Hugging Face ``transformers``: offload a ``Trainer``'s model with a callback.

:func:`~cpu_offload.offload_layers` works on any ``transformers`` (or peft) model as it
is; this module adds :class:`OffloadCallback`, which installs it when training begins
and removes it when training ends::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[OffloadCallback(0.5)])
    trainer.train()

or, with the layers chosen for a memory budget from the first step,
``OffloadCallback(memory_budget="20GiB")``.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..layer_hooks import OffloadLayersHandle, offload_layers
from ..stats import OffloadStats

__all__ = ["OffloadCallback"]


class OffloadCallback(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` that offloads the first ``k`` decoder layers while training, or
    applies the policy chosen for a ``memory_budget``.

    On ``on_train_begin`` (the model is on its device by then) it calls
    ``offload_layers(model, k, **options)`` (or ``offload_layers(model,
    memory_budget=..., **options)``); on ``on_train_end`` it removes the hooks.
    Evaluation inside training runs through the hooks under ``torch.no_grad()``, where
    nothing is saved and nothing moves.

    Args:
        num_offloaded_layers: ``k``, a number of layers or a fraction in ``[0, 1)`` of
            them, as for :func:`~cpu_offload.offload_layers`.
        memory_budget: instead of ``k``: bytes, a string such as ``"20GiB"``, or
            ``"auto"``; the first training step is measured and the policy chosen from
            the second (``callback.handle.plan``; docs/planning.md).
        **options: keyword arguments of :func:`~cpu_offload.get_cpu_offload_context`.

    Attributes:
        handle: the :class:`~cpu_offload.OffloadLayersHandle` while training (its
            ``offload_synchronizer.stats`` count what moved), else None.
        stats: what moved in the latest ``train()`` (kept after it ends), or None.
    """

    def __init__(
        self,
        num_offloaded_layers: int | float | None = None,
        *,
        memory_budget: int | str | None = None,
        **options: Any,
    ) -> None:
        if (num_offloaded_layers is None) == (memory_budget is None):
            raise TypeError(
                "OffloadCallback: pass either num_offloaded_layers (k) or memory_budget=..., "
                f"{'not both' if memory_budget is not None else 'got neither'}."
            )
        self.num_offloaded_layers = num_offloaded_layers
        self.memory_budget = memory_budget
        self.options = options
        self.handle: OffloadLayersHandle | None = None
        self.stats: OffloadStats | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            raise ValueError(
                "OffloadCallback: the Trainer passed no model to on_train_begin; add the "
                "callback to a Trainer built with a model (Trainer(model=..., "
                "callbacks=[OffloadCallback(k)]))."
            )
        self._remove()  # a train() that raised never reached on_train_end
        if self.memory_budget is not None:
            self.handle = offload_layers(model, memory_budget=self.memory_budget, **self.options)
        else:
            self.handle = offload_layers(model, self.num_offloaded_layers, **self.options)
        self.stats = self.handle.offload_synchronizer.stats

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
