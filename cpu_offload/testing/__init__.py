"""Tools to test offloading code on a machine without an accelerator.

The simulated runtime (``runtime.py``, ``simulator.py`` and ``sim_streams.py``: streams
whose hazards raise) and the timed runtime of a modeled accelerator (``timed_device.py``
and its clocks, memory, pinned memory, streams and report), which stand in for
``torch.cuda``; both model the caching allocator's per-stream pools
(``allocator_pools.py``).  The modeled accelerator captures and replays CUDA graphs
(``cuda_graphs.py``: the capture and its rules; ``cuda_graph_api.py``: ``CUDAGraph``,
``graph``).  Public as ``cpu_offload.testing``.

May import: device, errors.
"""

from __future__ import annotations

from .cuda_graphs import CaptureError
from .runtime import SimulatedRuntime, strict_runtime
from .simulator import SimulatedBackend, StreamCounters, StreamHazardError, strict_streams
from .timed_device import TimedRuntime, timed_runtime
from .timed_report import TimedReport

__all__ = [
    "CaptureError",
    "SimulatedBackend",
    "SimulatedRuntime",
    "StreamCounters",
    "StreamHazardError",
    "TimedReport",
    "TimedRuntime",
    "strict_runtime",
    "strict_streams",
    "timed_runtime",
]
