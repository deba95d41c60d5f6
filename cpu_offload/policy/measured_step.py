"""What a real step saves, per layer, measured by the offloader's own rules, and how long
each layer's forward takes (the measuring step of ``offload_layers(memory_budget=...)``).

NOTE [Measuring a step]
    A layer being measured runs inside the offload context with its layer state's
    saved-tensor hooks, as an offloaded layer does, but its offload never starts: every
    tensor autograd saves goes through ``push_tensor`` (the offloader's own rules decide
    what would move and what stays), stays on the device, and the pop hands it back as it
    was pushed, so the step computes exactly what it computes without offload.  When the
    layer's forward ends, the state's pending copies (after group processing) are exactly
    the bytes an offload of the layer would move, and the storages of what was pushed are
    the bytes it saves; the references to the pushed tensors are dropped then.  What a
    checkpointed layer would keep (its positional tensor inputs) is pushed into a
    scratch layer state that is dropped at once: the bytes a ``checkpoint+offload`` layer
    would move, by the same rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Parameter

from ..device.backend import DeviceBackend
from ..engine.layer_state import OffloadableLayerState
from ..hooks.eager import eager
from ..hooks.saving_protocol import has_saving_protocol
from ..hooks.selection import KEPT_BY_MODULES, PARAMETER, kept_because

__all__ = [
    "CENSUS_FIELDS",
    "LayerClock",
    "MeasuredLayer",
    "ObservedLayerState",
    "census_report",
    "census_rows",
    "checkpointed_bytes",
    "measure_inputs",
    "measure_pushed",
    "rescaled",
]


@dataclass
class MeasuredLayer:
    """What one layer of a real step saved, by the offloader's rules (the fields of
    :class:`cpu_offload.plan.LayerProfile` that a run can measure).

    Attributes:
        saved_bytes: activation bytes the layer saved: unique storages, without
            parameters and buffers.
        offloaded_bytes, tensors_offloaded: what offloading the layer moves per step.
        kept_bytes, kept_by_reason: what would stay on the device, and why.
        input_bytes: what the layer keeps saved when checkpointed (its positional
            tensor inputs), and
        input_offloaded_bytes, input_tensors_offloaded: what of it moves.
        forward_s: the layer's forward time (None: not timed in this step).
        recompute_bytes: what a checkpoint the model placed in the layer saves in
            forward, which its recompute holds in the layer's backward (NOTE [A
            checkpoint the model placed] in model_checkpoints.py); 0: none seen.
    """

    saved_bytes: int
    offloaded_bytes: int
    tensors_offloaded: int
    kept_bytes: int
    kept_by_reason: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    input_offloaded_bytes: int = 0
    input_tensors_offloaded: int = 0
    forward_s: float | None = None
    recompute_bytes: int = 0
    in_checkpoint: bool = False

    @property
    def by_the_model(self) -> bool:
        """Whether a checkpoint the model placed recomputes the layer already."""
        return bool(self.recompute_bytes) or self.in_checkpoint


class ObservedLayerState(OffloadableLayerState):
    """A layer state that also keeps what is pushed to it while :attr:`seen` is a list
    (NOTE [Measuring a step])."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: what was pushed since the layer's forward started, while it is measured
        self.seen: list[torch.Tensor] | None = None
        #: what a checkpoint the model placed saved meanwhile (model_checkpoints.py)
        self.checkpointed: list[torch.Tensor] | None = None

    @eager
    def push_tensor(self, tensor: Any) -> Any:
        seen = self.seen
        if seen is not None and isinstance(tensor, torch.Tensor):
            seen.append(tensor)
        return super().push_tensor(tensor)

    @eager
    def keep_tensor(self, tensor: torch.Tensor) -> tuple:
        seen = self.seen  # what modules= keeps is measured as saved too
        if seen is not None:
            seen.append(tensor)
        return super().keep_tensor(tensor)


def checkpointed_bytes(
    checkpointed: Sequence[torch.Tensor],
    seen: Sequence[torch.Tensor],
    excluded: frozenset[int] = frozenset(),
) -> int:
    """The bytes of the storages of ``checkpointed`` (what a checkpoint the model placed
    saved) that are not among ``seen``'s (what the layer saved) nor ``excluded``
    (parameters and buffers): what its recompute holds (NOTE [A checkpoint the model
    placed] in model_checkpoints.py)."""
    own = set(excluded)
    for tensor in seen:
        try:
            own.add(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    found: dict[int, int] = {}
    for tensor in checkpointed:
        if isinstance(tensor, Parameter):
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a subclass without storage of its own
        if storage._cdata not in own:
            found[storage._cdata] = storage.nbytes()
    return sum(found.values())


def measure_pushed(
    seen: Sequence[torch.Tensor],
    pending: Sequence[torch.Tensor],
    device: torch.device,
    min_numel: int,
    min_bytes: int,
    excluded: frozenset[int] = frozenset(),
) -> MeasuredLayer:
    """The bytes of a layer that pushed ``seen`` and would copy ``pending``.

    Args:
        seen: the tensors pushed (parameters among them are set apart).
        pending: the layer state's :meth:`~OffloadableLayerState.pending_copies`.
        device, min_numel, min_bytes: the offloader's device and thresholds (for the
            reasons of what stays).
        excluded: storages (``untyped_storage()._cdata``) of parameters and buffers.
    """
    activations: dict[int, int] = {}  # storage -> bytes
    kept: dict[int, str] = {}  # storage -> why it stays
    moving = {t.untyped_storage()._cdata for t in pending}
    for tensor in seen:
        if has_saving_protocol(tensor):
            continue  # saved as its components, which were pushed too
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a subclass without storage of its own
        key = storage._cdata
        if isinstance(tensor, Parameter) or key in excluded:
            continue
        reason = kept_because(tensor, device, min_numel, min_bytes)
        if reason == PARAMETER:  # a view or a cast of a weight
            continue
        activations[key] = storage.nbytes()
        if reason is None and key not in moving:
            reason = KEPT_BY_MODULES  # movable, and kept by its submodule's choice
        if reason is not None:
            kept.setdefault(key, reason)
    by_reason: dict[str, int] = {}
    for key, reason in kept.items():
        by_reason[reason] = by_reason.get(reason, 0) + activations[key]
    return MeasuredLayer(
        saved_bytes=sum(activations.values()),
        offloaded_bytes=sum(t.nbytes for t in pending),
        tensors_offloaded=len(pending),
        kept_bytes=sum(by_reason.values()),
        kept_by_reason=by_reason,
    )


def measure_inputs(
    record: MeasuredLayer,
    inputs: Sequence[torch.Tensor],
    new_state: Callable[[], OffloadableLayerState],
    measure: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], MeasuredLayer],
) -> None:
    """Fill ``record``'s input fields: what a checkpoint of the layer saves (its
    positional tensor inputs) pushed into a scratch state, dropped at once."""
    scratch = new_state()
    handles = [scratch.push_tensor(tensor) for tensor in inputs]
    pending = scratch.pending_copies()
    found = measure(inputs, pending)
    del handles, pending  # the scratch state's data goes with its handles
    record.input_bytes = found.saved_bytes
    record.input_offloaded_bytes = found.offloaded_bytes
    record.input_tensors_offloaded = found.tensors_offloaded


def rescaled(
    layers: Sequence[MeasuredLayer | None],
    before: Sequence[MeasuredLayer | None],
    checkpointed: list[bool],
) -> list[MeasuredLayer | None]:
    """A measurement taken while some layers were checkpointed: such a layer saved only
    its inputs, so its activations are those measured ``before``, scaled by its inputs;
    a layer not timed takes its time from ``before``, scaled by its bytes; a layer that
    did not run (None) keeps what was measured ``before``."""
    result: list[MeasuredLayer | None] = []
    for now, then, was_checkpointed in zip(layers, before, checkpointed):
        if now is None or then is None:
            result.append(now if now is not None else then)
            continue
        if was_checkpointed:
            ratio = now.input_bytes / then.input_bytes if then.input_bytes else 1.0
            now = MeasuredLayer(
                round(then.saved_bytes * ratio),
                round(then.offloaded_bytes * ratio),
                then.tensors_offloaded,
                round(then.kept_bytes * ratio),
                {k: round(v * ratio) for k, v in then.kept_by_reason.items()},
                now.input_bytes,
                now.input_offloaded_bytes,
                now.input_tensors_offloaded,
                now.forward_s,
            )
        if now.forward_s is None and then.forward_s is not None:
            ratio = now.saved_bytes / then.saved_bytes if then.saved_bytes else 1.0
            now.forward_s = then.forward_s * ratio
        result.append(now)
    return result


#: the fields a measured layer and the planner's census (``LayerProfile``) both have
CENSUS_FIELDS = (
    "saved_bytes",
    "offloaded_bytes",
    "tensors_offloaded",
    "kept_bytes",
    "input_bytes",
    "input_offloaded_bytes",
    "input_tensors_offloaded",
)


def census_rows(measured: Sequence[MeasuredLayer], profile: Any) -> list[tuple[int, str, int, int]]:
    """``(layer, field, measured, census)`` for every layer and byte field: the measured
    step against ``cpu_offload.plan.measure_layer``'s census of the layer (a
    ``LayerProfile``: layer 0 against it, the later layers against its ``following``)."""
    rows = []
    for index, layer in enumerate(measured):
        census = profile if index == 0 or profile.following is None else profile.following
        rows += [(index, f, getattr(layer, f), getattr(census, f)) for f in CENSUS_FIELDS]
    return rows


def census_report(measured: Sequence[MeasuredLayer], profile: Any) -> str:
    """:func:`census_rows` as a table."""
    lines = [f"{'layer':>5}  {'field':<24} {'measured':>14} {'census':>14}  agree"]
    for layer, name, found, census in census_rows(measured, profile):
        agree = "yes" if found == census else "NO"
        lines.append(f"{layer:>5}  {name:<24} {found:>14,} {census:>14,}  {agree}")
    return "\n".join(lines)


class LayerClock:
    """Each layer's forward time in one step: thread CPU time on a CPU, timing events
    on an accelerator's compute stream (read after one synchronisation, when asked)."""

    def __init__(self, backend: DeviceBackend, num_layers: int) -> None:
        self.backend = backend
        self.on_host = backend.device.type == "cpu"
        self.started: list[Any] = [None] * num_layers
        self.spans: list[Any] = [None] * num_layers

    def _now(self) -> Any:
        if self.on_host:
            return time.thread_time()
        event = self.backend.timing_event()
        event.record()
        return event

    def start(self, layer: int) -> None:
        self.started[layer] = self._now()

    def stop(self, layer: int) -> None:
        if self.started[layer] is not None:
            self.spans[layer] = (self.started[layer], self._now())

    def seconds(self) -> list[float | None]:
        """Per layer, its forward's seconds (None: not timed)."""
        found: list[float | None] = []
        for span in self.spans:
            if span is None:
                found.append(None)
            elif self.on_host:
                found.append(span[1] - span[0])
            else:
                span[1].synchronize()
                found.append(span[0].elapsed_time(span[1]) / 1e3)
        return found
