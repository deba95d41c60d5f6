"""cpu_offload: move saved activations to host memory during forward, prefetch for backward.

The public API mirrors TransformerEngine's ``get_cpu_offload_context``::

    ctx, sync_fn = get_cpu_offload_context(True, num_layers=2, model_layers=8)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync_fn(x)
"""

from __future__ import annotations

import importlib
from typing import Any

from .context import get_cpu_offload_context
from .engine.layer_context import OffloadContext
from .engine.layer_state import OffloadableLayerState
from .engine.manual_synchronizer import ManualOffloadSynchronizer
from .engine.synchronizer import DefaultOffloadSynchronizer
from .engine.transitions import LayerState
from .errors import CpuOffloadError, OffloadStateError
from .hooks.autograd_hooks import is_cpu_offload_enabled
from .hooks.marking import mark_activation_offload, mark_not_offload, start_offload
from .layer_hooks import OffloadLayersHandle, offload_layers
from .policy.selective_checkpoint import create_selective_checkpoint_contexts
from .report.stats import OffloadStats

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``cpu_offload.testing`` on first use: it imports torch._dynamo, which
    ``import cpu_offload`` leaves unloaded (it doubles the import's time)."""
    if name == "testing":
        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The stable names: TransformerEngine's functions and classes (as TE's own callers use
#: them), offload_layers, torch's selective checkpointing with offload, the layer states,
#: the statistics, the errors and the testing tools.  Everything else is importable from
#: its module and may change.
__all__ = [
    "CpuOffloadError",
    "DefaultOffloadSynchronizer",
    "LayerState",
    "ManualOffloadSynchronizer",
    "OffloadContext",
    "OffloadLayersHandle",
    "OffloadStateError",
    "OffloadStats",
    "OffloadableLayerState",
    "create_selective_checkpoint_contexts",
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "mark_activation_offload",
    "mark_not_offload",
    "offload_layers",
    "start_offload",
    "testing",
]
