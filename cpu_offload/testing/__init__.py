"""Tools to test offloading code on a machine without an accelerator."""

from __future__ import annotations

from .runtime import SimulatedRuntime, strict_runtime
from .simulator import SimulatedBackend, StreamCounters, StreamHazardError, strict_streams
from .timed_device import TimedRuntime, timed_runtime
from .timed_report import TimedReport

__all__ = [
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
