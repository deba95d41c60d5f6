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

NOTE [What a measured pass measures]
    Each layer is measured as it runs: a layer whose forward runs without grad (a
    frozen first layer under ``torch.no_grad()``) saves nothing, and is measured so.  A
    pass in which no layer ran with grad (evaluation) is not measured: the next one is.
    The measurement ends with the last layer, or, when the last layers did not run
    (skipped), when the next pass starts.  A layer that did not run in the measured pass
    (LayerDrop) is not measured: the listener plans it from a stand-in, and it is
    observed in later passes (as layer 0 is) until it runs with grad; then the listener
    gets its measurement (``layer_measured``) and plans again.  A forward that raises
    ends the measurement without a result, and drops everything it held: the tensors
    pushed to the observed layers and the noted inputs keep their autograd history,
    and holding them would keep the failed step's graph alive (NOTE [Saved tensors
    without their history] in layer_state.py).
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
    checkpointed_bytes,
    measure_inputs,
    measure_pushed,
)
from .reentrant_budget import ChunkMeasure

__all__ = [
    "MEASURED",
    "PlannedOffloadSynchronizer",
    "StepListener",
    "chunk_measure",
    "ran_in_checkpoint",
]

#: what the step report calls a layer of the measured first step (it runs as the model does)
MEASURED = "measured"


class StepListener(Protocol):
    """What the synchronizer tells the planner (``auto_policy.AutoPolicy``)."""

    def step_starts(self) -> None:
        """A forward pass is about to start (the step before it is over)."""

    def forward_measured(self, layers: list[MeasuredLayer | None]) -> None:
        """A measured pass's forward ended: what each layer saved (and its time); None
        for a layer that did not run in it."""

    def layer_measured(self, layer: int, record: MeasuredLayer) -> None:
        """A layer that did not run in the measured pass ran now (with grad)."""

    def first_layer(self, layer: MeasuredLayer) -> bool:
        """Layer 0 of a planned pass ended; True: measure the rest of the pass again."""
        return False

    def sample_memory(self, backward: bool) -> None:
        """A layer's forward ended, or backward reached a layer (``backward``): note the
        device memory allocated now (NOTE [A step's peak, the user's statistics] in
        budget_watch.py)."""

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
        #: layers not measured yet: they did not run in the measured pass
        self.unmeasured: set[int] = set()
        #: why no measurement was delivered yet (for the listener's messages)
        self.why_unmeasured = ""  # the first pass is measured
        self._with_grad: set[int] = set()  # layers that started with grad enabled
        self._skipping = False
        self._ran: set[int] = set()  # the layers of the measured pass run with grad

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
        # a measured pass, and a layer not measured yet (NOTE [Measuring a step]).
        current = self.current_pass
        return (
            layer in self._offloaded
            or layer == 0
            or layer in self.unmeasured
            or self.measuring(current)
            or (current is not None and current.moved_whole)
        )

    def skip_layer(self) -> None:
        self._skipping = True
        try:
            super().skip_layer()
        finally:
            self._skipping = False

    def note_inputs(self, tensors: list[torch.Tensor]) -> None:
        """The positional tensor inputs of the layer whose forward is starting (what a
        checkpoint of it would save), kept until its forward ends if it is measured."""
        current = self.current_pass
        if current is not None and current.layers_forwarded:
            layer = current.layers_forwarded - 1
            if layer in self._with_grad and (
                layer == 0 or layer in self.unmeasured or self.measuring(current)
            ):
                self._inputs[layer] = tensors

    def _new_pass(self) -> ForwardPass:
        measured = self._measuring() if self._measuring is not None else None
        if measured is not None and measured.backward_reached:
            self._deliver()  # the last layers did not run: what ran is measured
        elif self._measuring is not None:
            self._stop_measuring(again=True)  # left before its end, and no backward
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
        self._ran = set()
        self._clock = LayerClock(self.backend, self.model_layers)

    def _stop_measuring(self, again: bool) -> None:
        self._measuring = None
        self.measure_next = self.measure_next or again

    def _on_forward(self, forward_pass: ForwardPass, layer: int) -> None:
        super()._on_forward(forward_pass, layer)
        self._with_grad.discard(layer)
        if self._skipping:
            return  # a layer that did not run is not measured (NOTE [What a measured ...])
        measuring = self.measuring(forward_pass)
        if layer == 0 or measuring or layer in self.unmeasured:
            if torch.is_grad_enabled():
                self._with_grad.add(layer)
            state = forward_pass.state(layer)
            if isinstance(state, ObservedLayerState):
                state.seen, state.checkpointed = [], []
            if measuring and self._clock is not None:
                self._clock.start(layer)

    def fwd_end(self) -> None:
        self.listener.sample_memory(False)
        current = self.current_pass
        if current is not None and current.layers_forwarded:
            layer = current.layers_forwarded - 1
            state = current.made_state(layer)
            if isinstance(state, ObservedLayerState) and state.seen is not None:
                self._layer_ended(current, layer, state)
        super().fwd_end()

    def abort_forward(self, failed: bool = True) -> None:
        current = self.current_pass
        if not failed and current is not None and current.backward_reached:
            if self.measuring(current):
                self._deliver()  # its last layers did not run: what ran is measured
            super().abort_forward(failed)
            return
        if current is not None:
            # Drop what the observed layers hold: the pushed tensors and the inputs keep
            # their history, and so the failed step's graph (NOTE [What a measured ...]).
            for layer in range(current.layers_forwarded):
                state = current.made_state(layer)
                if isinstance(state, ObservedLayerState):
                    state.seen = state.checkpointed = None
        self._inputs = {}
        self._with_grad.clear()
        if self.measuring(current):
            self.why_unmeasured = "the measured forward raised an exception, or was left"
            self._stop_measuring(again=True)  # an exception: measure the next pass
        super().abort_forward(failed)

    def checkpointed(self) -> list[torch.Tensor] | None:
        """Where a checkpoint the model placed in the layer whose forward runs notes what
        it saves, while that layer is measured (NOTE [A checkpoint the model placed] in
        model_checkpoints.py); None otherwise."""
        current = self.current_pass
        if current is None or not current.layers_forwarded:
            return None
        state = current.made_state(current.layers_forwarded - 1)
        return state.checkpointed if isinstance(state, ObservedLayerState) else None

    def _on_backward(self, forward_pass: ForwardPass, layer: int) -> None:
        self.listener.sample_memory(True)
        super()._on_backward(forward_pass, layer)

    def _layer_ended(
        self, forward_pass: ForwardPass, layer: int, state: ObservedLayerState
    ) -> None:
        measuring = self.measuring(forward_pass)
        if measuring and self._clock is not None:
            self._clock.stop(layer)
        seen, state.seen = state.seen or [], None
        record = self._measure(seen, state.pending_copies())
        checkpointed, state.checkpointed = state.checkpointed, None
        if checkpointed:  # NOTE [A checkpoint the model placed] in model_checkpoints.py
            record.recompute_bytes = checkpointed_bytes(checkpointed, seen, self.excluded)
        del seen, checkpointed
        inputs = self._inputs.pop(layer, None)
        if inputs:
            measure_inputs(
                record,
                inputs,
                lambda: self.new_layer_state(layer, f"the inputs of layer {layer}"),
                self._measure,
            )
        with_grad = layer in self._with_grad
        self._with_grad.discard(layer)
        if not measuring:
            if layer in self.unmeasured and with_grad:
                self.unmeasured.discard(layer)
                self.listener.layer_measured(layer, record)
            if layer == 0 and self.listener.first_layer(record):
                self._start_measuring(forward_pass)  # the rest of this pass
                self._records[0] = record
                self._ran = {0} if with_grad else set()
            return
        self._records[layer] = record
        if with_grad:
            self._ran.add(layer)
        if layer == self.model_layers - 1:
            self._deliver()

    def _deliver(self) -> None:
        """The measured pass's forward is over: hand what ran to the listener, or, if
        no layer ran with grad (evaluation), measure the next pass."""
        clock, records, ran = self._clock, self._records, self._ran
        if not ran:
            self.why_unmeasured = (
                "no layer of a forward pass ran with grad enabled (evaluation, or "
                "torch.no_grad() around the whole forward)"
            )
            self._stop_measuring(again=True)
            return
        self._stop_measuring(again=False)
        times = clock.seconds() if clock is not None else [None] * len(records)
        found: list[MeasuredLayer | None] = []
        for record, seconds in zip(records, times):
            if record is not None:  # ran (with grad, or without: it saved nothing)
                record.forward_s = seconds
                found.append(record)
            else:
                found.append(None)  # did not run: measured when it first runs
        self.unmeasured = {layer for layer, record in enumerate(found) if record is None}
        self.listener.forward_measured(found)

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


def ran_in_checkpoint(synchronizer: PlannedOffloadSynchronizer, layer: int) -> None:
    """Layer ``layer`` runs inside a reentrant checkpoint's forward, under no-grad: it
    counts as run with grad (NOTE [A budget around reentrant checkpoints] in
    reentrant_budget.py)."""
    current = synchronizer.current_pass
    if current is not None and (
        layer == 0 or layer in synchronizer.unmeasured or synchronizer.measuring(current)
    ):
        synchronizer._with_grad.add(layer)


def chunk_measure(synchronizer: PlannedOffloadSynchronizer, layer: int) -> ChunkMeasure | None:
    """Where the pass is measured, what counts the bytes of the reentrant checkpoint's
    chunk that starts at ``layer`` (reentrant_budget.py); None otherwise."""
    if not synchronizer.measuring(synchronizer.current_pass):
        return None
    return ChunkMeasure(
        synchronizer._records,
        lambda: synchronizer.new_layer_state(layer, f"the checkpoint's inputs at layer {layer}"),
        synchronizer._measure,
        synchronizer.excluded,
    )
