"""cpu_offload: move saved activations to host memory during forward, prefetch for backward.

The public API mirrors TransformerEngine's ``get_cpu_offload_context``::

    ctx, sync_fn = get_cpu_offload_context(True, num_layers=2, model_layers=8)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync_fn(x)
"""

from __future__ import annotations

from .context import (
    OffloadContext,
    get_cpu_offload_context,
    is_cpu_offload_enabled,
    mark_activation_offload,
    mark_not_offload,
    start_offload,
)
from .errors import CpuOffloadError, OffloadStateError
from .forward_pass import ForwardPass
from .layer_hooks import OffloadLayersHandle, offload_layers
from .layer_state import LayerState, OffloadableLayerState
from .selection import DEFAULT_MIN_OFFLOAD_NUMEL
from .stats import OffloadStats
from .synchronizer import (
    DefaultOffloadSynchronizer,
    ManualOffloadSynchronizer,
    OffloadSynchronizer,
)
from .tensor_group import TensorGroup, TensorGroupProcessor

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MIN_OFFLOAD_NUMEL",
    "CpuOffloadError",
    "DefaultOffloadSynchronizer",
    "ForwardPass",
    "LayerState",
    "ManualOffloadSynchronizer",
    "OffloadContext",
    "OffloadSynchronizer",
    "OffloadStateError",
    "OffloadLayersHandle",
    "OffloadStats",
    "OffloadableLayerState",
    "TensorGroup",
    "TensorGroupProcessor",
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "mark_activation_offload",
    "mark_not_offload",
    "offload_layers",
    "start_offload",
]
