"""Exception types raised by cpu_offload."""

from __future__ import annotations

__all__ = ["CpuOffloadError", "OffloadStateError"]


class CpuOffloadError(RuntimeError):
    """Base class of every error cpu_offload raises for a misuse or a bad state."""


class OffloadStateError(CpuOffloadError):
    """An operation was called on a layer whose state does not allow it."""
