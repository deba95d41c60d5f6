"""One forward pass in flight: the layer states it owns and where its backward is."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from .layer_state import OffloadableLayerState

__all__ = ["ForwardPass"]

_pass_ids = itertools.count()


class ForwardPass:
    """The saved tensors of one forward pass through ``num_layers`` layers.

    A pass lives as long as its autograd graph (the backward hooks that ``sync_fn``
    registers hold it) and owns one :class:`OffloadableLayerState` per layer, so
    several passes can be in flight at once (gradient accumulation, pipeline
    schedules) without touching each other's memory.

    Attributes:
        index: a number unique to this pass within the process.
        layer_states: one state per layer.
        layers_forwarded: how many layers' forwards have started.
        previous_bwd_layer: the layer whose backward ran last, not yet released.
        finish_queued: whether the end-of-backward callback is queued.
        has_backward_hooks: whether ``sync_fn`` attached the pass to its graph.
    """

    def __init__(
        self, num_layers: int, make_state: Callable[[int, str], OffloadableLayerState]
    ) -> None:
        self.index = next(_pass_ids)
        self.layer_states = [
            make_state(layer, f"layer {layer} of forward pass {self.index}")
            for layer in range(num_layers)
        ]
        self.layers_forwarded = 0
        self.previous_bwd_layer: int | None = None
        self.finish_queued = False
        self.has_backward_hooks = False  # sync_fn attached it to its graph

    @property
    def num_layers(self) -> int:
        return len(self.layer_states)

    @property
    def forward_done(self) -> bool:
        return self.layers_forwarded == self.num_layers

    def release_all(self) -> None:
        """Drop every layer's memory (end of backward, or a discarded pass)."""
        for state in self.layer_states:
            state.release_all_memory()
        self.previous_bwd_layer = None

    def get_offloaded_total_size_mb(self) -> float:
        return sum(state.get_offloaded_total_size_mb() for state in self.layer_states)

    def __repr__(self) -> str:
        return (
            f"ForwardPass(index={self.index}, layers_forwarded={self.layers_forwarded}/"
            f"{self.num_layers})"
        )
