"""Tools to test offloading code on a machine without an accelerator."""

from __future__ import annotations

from .simulator import SimulatedBackend, StreamCounters, StreamHazardError, strict_streams

__all__ = ["SimulatedBackend", "StreamCounters", "StreamHazardError", "strict_streams"]
