"""Exception types raised by cpu_offload."""

from __future__ import annotations

__all__ = ["CpuOffloadError", "OffloadStateError", "internal_check"]


class CpuOffloadError(RuntimeError):
    """Base class of every error cpu_offload raises for a misuse or a bad state."""


class OffloadStateError(CpuOffloadError):
    """An operation was called on a layer whose state does not allow it."""


def internal_check(condition: bool, message: str) -> None:
    """Raise for a broken internal invariant (a bug in cpu_offload, not in user code)."""
    if not condition:
        raise CpuOffloadError(
            f"cpu_offload internal error: {message}. This is a bug in cpu_offload; "
            "please report it with the code that triggered it."
        )
