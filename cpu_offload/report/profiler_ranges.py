"""Named ranges around the offloader's copies, waits and releases, for profilers.

NOTE [Profiler ranges]
    Where a layer (or chunk) copies to the host, releases its device memory, copies
    back, waits for that copy, or is released after its backward, the work runs inside
    a ``torch.profiler.record_function`` range named ``cpu_offload::<operation>
    <layer>`` (``cpu_offload::offload layer 3``), while a profiler runs: in a
    ``torch.profiler`` trace the range sits on the host thread, and on a GPU the copy
    kernels it launched on the offload stream are linked to it; under
    ``torch.autograd.profiler.emit_nvtx()`` the same ranges are NVTX ranges, which
    Nsight Systems shows.  Without a profiler the cost is one call that asks torch
    whether one runs, per layer and operation, never per saved tensor: a layer with
    nothing to copy asks nothing.  The layer's forward pass is left out of the name, so
    that a profiler's table adds the same layer's ranges of every step together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

__all__ = ["in_range", "range_name"]

#: whether a profiler (torch.profiler, emit_nvtx, the autograd profiler) is recording
_profiling: Callable[[], bool] = torch._C._autograd._profiler_enabled


def range_name(operation: str, layer_name: str) -> str:
    """``cpu_offload::offload layer 3`` for ``("offload", "layer 3 of forward pass 7")``."""
    return f"cpu_offload::{operation} {layer_name.partition(' of ')[0]}"


def in_range(operation: str, layer_name: str, function: Callable[..., Any], *args: Any) -> None:
    """``function(*args)``, inside a profiler range when a profiler runs (NOTE [Profiler
    ranges])."""
    if _profiling():
        with record_function(range_name(operation, layer_name)):
            function(*args)
    else:
        function(*args)
