"""The default schedule with a policy that changes between steps: it measures a step, then
offloads the layers a plan chooses (``offload_layers(model, memory_budget=...)``).

A :class:`PlannedOffloadSynchronizer` starts with nothing offloaded and measures its
first forward pass with grad enabled (NOTE [Measuring a step] in measured_step.py).  It
tells its :class:`StepListener` (``auto_policy.py``) when a pass starts and when a
measured forward ends; the listener answers with :meth:`schedule` (the layers to offload
from the next pass on).  Layer 0 is observed in every pass (its saved tensors go through
its layer state, which holds them where they are unless the plan offloads it), so the
listener sees at once when a step saves more than the plan was made for (a larger
input), and the rest of that pass is measured again.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..engine.forward_pass import ForwardPass
from ..engine.schedule import check_offloaded_layers, schedule_points
from ..engine.synchronizer import DefaultOffloadSynchronizer
from .measured_step import (
    LayerClock,
    MeasuredLayer,
    ObservedLayerState,
    measure_inputs,
    measure_pushed,
)

__all__ = ["MEASURED", "PlannedOffloadSynchronizer", "StepListener"]

#: what the step report calls a layer of the measured first step (it runs as the model does)
MEASURED = "measured"


class StepListener(Protocol):
    """What the synchronizer tells the planner (``auto_policy.AutoPolicy``)."""

    def step_starts(self) -> None:
        """A forward pass is about to start (the step before it is over)."""

    def forward_measured(self, layers: list[MeasuredLayer]) -> None:
        """A measured pass's forward ended: what each layer saved (and its time)."""

    def first_layer(self, layer: MeasuredLayer) -> bool:
        """Layer 0 of a planned pass ended; True: measure the rest of the pass again."""
        return False

    @property
    def policy(self) -> list[str] | None:
        """The plan's policy in force; None while the first step is measured."""


class PlannedOffloadSynchronizer(DefaultOffloadSynchronizer):
    """The default schedule, measured once and then given the layers to offload.

    Args:
        num_layers: layers per forward pass.
        listener: told when passes start and what was measured.
        excluded: storages of the model's parameters and buffers (not activations).
        **options: as for :class:`DefaultOffloadSynchronizer` (thresholds, device, ...).
    """

    layer_state_class = ObservedLayerState

    def __init__(
        self,
        num_layers: int,
        listener: StepListener,
        *,
        excluded: frozenset[int] = frozenset(),
        **options: Any,
    ) -> None:
        super().__init__(num_layers, 0, **options)
        self.listener = listener
        self.excluded = excluded
        #: whether the next pass is measured
        self.measure_next = True
        self._measuring: weakref.ref[ForwardPass] | None = None
        self._records: list[MeasuredLayer | None] = []
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._clock: LayerClock | None = None

    @property
    def plan(self) -> Any:
        """The listener's plan in force (a ``PolicyPlan``), None until one is made."""
        return getattr(self.listener, "plan", None)

    def schedule(self, offloaded_layers: Sequence[int]) -> None:
        """Offload ``offloaded_layers`` from the next forward pass on (the default
        schedule's release and reload points for them, ``schedule.py``)."""
        chosen = check_offloaded_layers(offloaded_layers, self.model_layers)
        release: defaultdict[int, list[int]] = defaultdict(list)
        reload: defaultdict[int, list[int]] = defaultdict(list)
        for layer, (at_forward, at_backward) in schedule_points(self.model_layers, chosen).items():
            release[at_forward].append(layer)
            reload[at_backward].append(layer)
        self.num_offloaded_layers = len(chosen)
        self.offloaded_layers = chosen
        self._offloaded = frozenset(chosen)
        self.release_schedule, self.reload_schedule = release, reload

    def measuring(self, forward_pass: ForwardPass | None) -> bool:
        """Whether ``forward_pass`` is being measured."""
        measured = self._measuring() if self._measuring is not None else None
        return forward_pass is not None and measured is forward_pass

    def layer_is_offloaded(self, layer: int) -> bool:
        # Observed layers run with their state's hooks too: layer 0, and every layer of
        # a measured pass (NOTE [Measuring a step]).
        return layer in self._offloaded or layer == 0 or self.measuring(self.current_pass)

    def note_inputs(self, tensors: list[torch.Tensor]) -> None:
        """The positional tensor inputs of the layer whose forward is starting (what a
        checkpoint of it would save), kept until its forward ends if it is measured."""
        current = self.current_pass
        if current is not None and current.layers_forwarded:
            layer = current.layers_forwarded - 1
            if layer == 0 or self.measuring(current):
                self._inputs[layer] = tensors

    def _new_pass(self) -> ForwardPass:
        self.listener.step_starts()
        self._inputs = {}
        forward_pass = super()._new_pass()
        policy = self.listener.policy  # for the step report: the plan may change
        forward_pass.choices = policy or [MEASURED] * self.model_layers
        if self.measure_next:
            self.measure_next = False
            self._start_measuring(forward_pass)
        return forward_pass

    def _start_measuring(self, forward_pass: ForwardPass) -> None:
        self._measuring = forward_pass.weak
        self._records = [None] * self.model_layers
        self._clock = LayerClock(self.backend, self.model_layers)

    def _stop_measuring(self, again: bool) -> None:
        self._measuring = None
        self.measure_next = self.measure_next or again

    def _on_forward(self, forward_pass: ForwardPass, layer: int) -> None:
        super()._on_forward(forward_pass, layer)
        measuring = self.measuring(forward_pass)
        if measuring and not torch.is_grad_enabled():
            self._stop_measuring(again=True)  # nothing is saved: measure the next pass
            measuring = False
        if layer == 0 or measuring:
            state = forward_pass.state(layer)
            if isinstance(state, ObservedLayerState):
                state.seen = []
            if measuring and self._clock is not None:
                self._clock.start(layer)

    def fwd_end(self) -> None:
        current = self.current_pass
        if current is not None and current.layers_forwarded:
            layer = current.layers_forwarded - 1
            state = current.made_state(layer)
            if isinstance(state, ObservedLayerState) and state.seen is not None:
                self._layer_ended(current, layer, state)
        super().fwd_end()

    def abort_forward(self) -> None:
        if self.measuring(self.current_pass):
            self._stop_measuring(again=True)  # an exception: measure the next pass
        super().abort_forward()

    def _layer_ended(
        self, forward_pass: ForwardPass, layer: int, state: ObservedLayerState
    ) -> None:
        measuring = self.measuring(forward_pass)
        if measuring and self._clock is not None:
            self._clock.stop(layer)
        seen, state.seen = state.seen or [], None
        record = self._measure(seen, state.pending_copies())
        del seen
        inputs = self._inputs.pop(layer, None)
        if inputs:
            measure_inputs(
                record,
                inputs,
                lambda: self.new_layer_state(layer, f"the inputs of layer {layer}"),
                self._measure,
            )
        if not measuring:
            if layer == 0 and self.listener.first_layer(record):
                self._start_measuring(forward_pass)  # the rest of this pass
                self._records[0] = record
            return
        self._records[layer] = record
        if layer == self.model_layers - 1:
            clock, records = self._clock, self._records
            self._stop_measuring(again=False)
            times = clock.seconds() if clock is not None else [None] * len(records)
            for found, seconds in zip(records, times):
                if found is not None:
                    found.forward_s = seconds
            self.listener.forward_measured([r or MeasuredLayer(0, 0, 0, 0) for r in records])

    def _measure(
        self, seen: Sequence[torch.Tensor], pending: Sequence[torch.Tensor]
    ) -> MeasuredLayer:
        return measure_pushed(
            seen,
            pending,
            self.backend.device,
            self.min_offload_numel,
            self.min_offload_bytes,
            self.excluded,
        )
