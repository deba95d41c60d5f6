"""The manual synchronizer: nothing happens by itself, the user calls the transitions."""

from __future__ import annotations

from .layer_state import OffloadableLayerState
from .synchronizer import OffloadSynchronizer, PassRef
from .transitions import LayerState

__all__ = ["ManualOffloadSynchronizer"]


class ManualOffloadSynchronizer(OffloadSynchronizer):
    """Nothing happens by itself: the user calls the three transitions.

    A layer none of them was called for keeps its tensors on the device. Each
    method takes an optional ``forward_pass`` (a :class:`ForwardPass` or its index);
    by default the latest pass in flight is used.

    Example:
        >>> from cpu_offload import get_cpu_offload_context
        >>> import torch
        >>> layers = [torch.nn.Linear(64, 64) for _ in range(3)]
        >>> ctx, sync_fn, controller = get_cpu_offload_context(
        ...     True, model_layers=3, manual_synchronization=True, min_offload_numel=0)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for i, layer in enumerate(layers):
        ...     with ctx:
        ...         x = layer(x).relu()
        ...     x = sync_fn(x)
        ...     controller.start_offload_layer(i)
        >>> for i in range(3):
        ...     controller.release_activation_forward_gpu_memory(i)
        >>> for i in reversed(range(3)):
        ...     controller.start_reload_layer(i)
        >>> x.sum().backward()
    """

    reload_advice = "Call start_reload_layer(i) before backward reaches the layer to prefetch it."
    #: a backward with the graph retained prepares no second backward (NOTE [A backward in
    #: two phases]): every reload is the controller's (TransformerEngine's contract)
    arms_second_backward = False

    def start_offload_layer(self, layer_id: int, forward_pass: PassRef = None) -> None:
        """Queue the copies of a layer's saved tensors to the host."""
        self._state(layer_id, forward_pass).start_offload()

    def release_activation_forward_gpu_memory(
        self, layer_id: int, forward_pass: PassRef = None
    ) -> None:
        """Drop the layer's device tensors once their copies have finished."""
        self._state(layer_id, forward_pass).release_activation_forward_gpu_memory()

    def start_reload_layer(self, layer_id: int, forward_pass: PassRef = None) -> None:
        """Queue the copies of a layer's tensors back to the device; a layer already
        reloading is left as it is (a repeated prefetch request)."""
        state = self._state(layer_id, forward_pass)
        if state.state is not LayerState.RELOAD_STARTED:
            state.start_reload()

    def _state(self, layer_id: int, forward_pass: PassRef) -> OffloadableLayerState:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(
                f"cpu_offload: layer_id must be an int in [0, {self.model_layers - 1}], got "
                f"{type(layer_id).__name__} {layer_id!r}."
            )
        if not 0 <= layer_id < self.model_layers:
            raise ValueError(
                f"cpu_offload: layer_id must be an int in [0, {self.model_layers - 1}], "
                f"got {layer_id!r}."
            )
        return self.resolve_pass(forward_pass).state(layer_id)
