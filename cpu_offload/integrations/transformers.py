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
from ..report.stats import OffloadStats
from ..report.step_report import StepReport

__all__ = ["LOG_KEYS", "SHORT_LOG_KEYS", "OffloadCallback", "logged_scalars"]

#: what ``OffloadCallback(log_keys=...)`` takes
LOG_KEYS = ("short", "all", "none")
#: the report's scalars logged by default (``step`` as ``micro_batch``)
SHORT_LOG_KEYS = ("step", "moved_bytes", "kept_bytes", "host_reserved_bytes", "device_peak_bytes")


def logged_scalars(scalars: dict[str, int], log_keys: str) -> dict[str, int]:
    """A report's ``to_dict()`` as ``OffloadCallback`` logs it: under ``cpu_offload/`` keys,
    ``step`` (micro-batches) as ``micro_batch``, the keys ``log_keys`` asks for.

    Example:
        >>> logged_scalars({"step": 3, "moved_bytes": 8, "saved_bytes": 9}, "short")
        {'cpu_offload/micro_batch': 3, 'cpu_offload/moved_bytes': 8}
    """
    if log_keys == "none":
        return {}
    kept = scalars if log_keys == "all" else {k: scalars[k] for k in SHORT_LOG_KEYS if k in scalars}
    return {f"cpu_offload/{'micro_batch' if k == 'step' else k}": v for k, v in kept.items()}


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
        log_keys: ``"short"`` (the default), ``"all"`` or ``"none"``: which of the report's
            scalars each logged line gets.
        **options: keyword arguments of :func:`~cpu_offload.get_cpu_offload_context`.

    At each logging step (``on_log``) it adds scalars of the last step's report
    (:meth:`report`, ``to_dict()``) to the Trainer's logs under ``cpu_offload/`` keys:
    ``log_history`` has them, and so do the callbacks that run after this one.  By default
    a short set (:data:`SHORT_LOG_KEYS`: the micro-batches so far, bytes moved and kept,
    host memory reserved, the device's peak where known); ``log_keys="all"`` adds every
    scalar of ``to_dict()``, ``log_keys="none"`` none.  The report's ``step`` counts
    forward passes and their backwards, micro-batches, where the Trainer's ``step`` counts
    optimizer steps: it is logged as ``cpu_offload/micro_batch``.
    transformers runs the reporting callbacks of ``report_to`` (W&B, TensorBoard) before
    the ones passed in ``callbacks=``; to have the keys there too, put this one first:
    ``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(callback))``.

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
        log_keys: str = "short",
        **options: Any,
    ) -> None:
        if log_keys not in LOG_KEYS:
            raise ValueError(
                f"OffloadCallback: log_keys must be one of {', '.join(map(repr, LOG_KEYS))} "
                f"(the report's scalars each logged line gets), got {log_keys!r}."
            )
        if (num_offloaded_layers is None) == (memory_budget is None):
            raise TypeError(
                "OffloadCallback: pass either num_offloaded_layers (k) or memory_budget=..., "
                f"{'not both' if memory_budget is not None else 'got neither'}."
            )
        self.num_offloaded_layers = num_offloaded_layers
        self.memory_budget = memory_budget
        self.log_keys = log_keys
        self.options = options
        self.handle: OffloadLayersHandle | None = None
        self.stats: OffloadStats | None = None
        self._last_report = StepReport()

    def report(self) -> StepReport:
        """The last step's report (:meth:`OffloadLayersHandle.report`), kept after
        training ends."""
        return self.handle.report() if self.handle is not None else self._last_report

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or self.handle is None:
            return
        scalars = logged_scalars(self.handle.report().to_dict(), self.log_keys)
        history = state.log_history
        if history and logs.keys() <= history[-1].keys():  # the entry Trainer.log just made
            history[-1].update(scalars)
        logs.update(scalars)

    def __repr__(self) -> str:
        chosen = (
            f"memory_budget={self.memory_budget!r}"
            if self.memory_budget is not None
            else repr(self.num_offloaded_layers)
        )
        logged = "" if self.log_keys == "short" else f", log_keys={self.log_keys!r}"
        options = logged + "".join(f", {name}={value!r}" for name, value in self.options.items())
        where = f"training: {self.handle!r}" if self.handle is not None else "not training"
        return f"OffloadCallback({chosen}{options}; {where})"

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
            self._last_report = self.handle.report()
            self.handle.remove()
            self.handle = None
