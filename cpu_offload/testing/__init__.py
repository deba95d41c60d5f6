"""Tools to test offloading code on a machine without an accelerator."""

from __future__ import annotations

from .runtime import SimulatedRuntime, strict_runtime
from .simulator import SimulatedBackend, StreamCounters, StreamHazardError, strict_streams

__all__ = [
    "SimulatedBackend",
    "SimulatedRuntime",
    "StreamCounters",
    "StreamHazardError",
    "strict_runtime",
    "strict_streams",
]
