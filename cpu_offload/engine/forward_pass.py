"""One forward pass in flight: the layer states it owns and where its backward is.

NOTE [A pass that saves nothing]
    A forward under ``torch.no_grad()`` (evaluation between micro-batches) goes through
    the layers' contexts as any other and is a pass, but saves nothing and has no
    backward.  A pass counts from the first of its layers that starts with grad enabled
    (``with_grad``): only then is it counted (``stats.forward_passes``), placed in the
    backward queue (``waiting_passes``) and, with ``keep_passes``, moved whole or not.
    A pass none of whose layers ran with grad is none of these: it moves nothing, and
    holding its output does not push the next training pass down the queue.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..report.step_record import Measured, StepRecord
from .layer_state import OffloadableLayerState

__all__ = ["ForwardPass", "GraphToken"]


class GraphToken:
    """Held by the backward hooks of a pass: alive while any hooked node of its graph is."""

    __slots__ = ("__weakref__",)


class ForwardPass:
    """The saved tensors of one forward pass through ``model_layers`` layers.

    A pass lives as long as its autograd graph (the backward hooks that ``sync_fn``
    registers hold it) and owns one :class:`OffloadableLayerState` per layer, so
    several passes can be in flight at once (gradient accumulation, pipeline
    schedules) without touching each other's memory.

    Attributes:
        index: the pass's number, counted per synchronizer from 0 (a handle's first
            step is its forward pass 0).
        layer_states: one state per layer (see :meth:`state`).
        model_layers: how many.
        layers_forwarded: how many layers' forwards have started.
        previous_bwd_layer: the layer whose backward ran last, not yet released.
        finish_queued: whether the end-of-backward callback is queued, and
        backward_call: the backward it was queued for (weak; backward_hook.py).
        backward_reached: whether a backward has reached the pass (no layer of it
            forwards after that).
        hooked_output: the latest tensor ``sync_fn`` hooked (weak), and
        hooked_layers: the layers whose backward starts at its node.
        moved_whole: every layer of the pass goes to the host, the last included
            (``keep_passes``: NOTE [Moving a pass whole] in pass_schedule.py), and
        brought_back: whether its reload has started, and
        reload_next: the next of its layers to reload, from the last down (-1: none).
        with_grad: whether a layer of it started with grad enabled (NOTE [A pass that
            saves nothing]).
        thread: the thread that started its forward (its backward queue's: NOTE [A
            backward queue per thread] in pass_schedule.py).
    """

    def __init__(
        self,
        model_layers: int,
        make_state: Callable[[int, str], OffloadableLayerState],
        index: int,
    ) -> None:
        self.index = index
        self._make_state = make_state
        self._states: list[OffloadableLayerState | None] = [None] * model_layers
        self.model_layers = model_layers
        #: a weak reference to the pass (one, made once: layers ask for it)
        self.weak = weakref.ref(self)
        self.layers_forwarded = 0
        self.previous_bwd_layer: int | None = None
        self.finish_queued = False
        self.backward_call: weakref.ref[Any] | None = None  # a BackwardCall
        self.backward_reached = False
        #: the pass whose forward had ended when this one started (weak)
        self.follows: weakref.ref[ForwardPass] | None = None
        self.hooked_output: weakref.ref[torch.Tensor] | None = None
        self.hooked_layers: list[int] = []
        self._last_output: StorageWeakRef | None = None
        self._token: weakref.ref[GraphToken] | None = None
        #: a layer of the pass is inside the offload context now (entered, not left)
        self.layer_open = False
        #: memory when the forward ended, and the policy it ran under where that changes
        #: between steps (for the step report)
        self.end_of_forward: Measured | None = None
        self.choices: list[str] | None = None
        self.with_grad = False
        self.thread = threading.get_ident()
        self.moved_whole = False
        self.brought_back = False
        self.reload_next = -1

    def state(self, layer: int) -> OffloadableLayerState:
        """The state of ``layer``, made when first asked for: a layer that is not
        offloaded never needs one, and making one costs more than a layer's hooks."""
        state = self._states[layer]
        if state is None:
            state = self._make_state(layer, f"layer {layer} of forward pass {self.index}")
            self._states[layer] = state
        return state

    def made_state(self, layer: int) -> OffloadableLayerState | None:
        """The state of ``layer`` if it was made (else nothing was ever pushed to it)."""
        return self._states[layer]

    def step_record(self) -> StepRecord:
        """The pass as a step that ended, for the step report."""
        record = StepRecord(self.index, list(self._states), self.end_of_forward)
        record.choices = self.choices
        return record

    @property
    def layer_states(self) -> list[OffloadableLayerState]:
        """One state per layer (made now where not made yet)."""
        return [self.state(layer) for layer in range(self.model_layers)]

    def graph_token(self) -> GraphToken:
        """An object the backward hooks hold: alive while any hooked node of the graph is."""
        token = self._token() if self._token is not None else None
        if token is None:
            token = GraphToken()
            self._token = weakref.ref(token)
        return token

    def note_output(self, tensor: torch.Tensor) -> None:
        """Remember (weakly) the storage of the latest layer's output."""
        try:
            self._last_output = StorageWeakRef(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            self._last_output = None  # no single storage: cannot tell

    def abandoned(self) -> bool:
        """Whether nobody can continue this forward: the latest layer's output is gone,
        and so is every node of its graph that a backward hook sits on; or, before any
        layer handed an output on, the layer left inside the context (a forward
        interrupted in its first layer) holds nothing any more."""
        if self._token is not None and self._token() is not None:
            return False
        if self._last_output is not None:
            return self._last_output.expired()
        return self.layer_open and not any(
            state is not None and state.holds_data() for state in self._states
        )

    @property
    def forward_done(self) -> bool:
        return self.layers_forwarded == self.model_layers

    def get_offloaded_total_size_mb(self) -> float:
        return sum(
            state.get_offloaded_total_size_mb() for state in self._states if state is not None
        )

    def __repr__(self) -> str:
        return (
            f"ForwardPass(index={self.index}, layers_forwarded={self.layers_forwarded}/"
            f"{self.model_layers})"
        )
