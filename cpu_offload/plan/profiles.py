"""The planner's device profiles: ``cpu_offload/device/profiles.py``, where the modeled
runtime of ``cpu_offload.testing`` reads the same figures (one set of numbers for both)."""

from __future__ import annotations

from ..device.profiles import (
    ACHIEVED_FRACTION,
    ACHIEVED_MEMORY_FRACTION,
    PROFILES,
    DeviceProfile,
    get_profile,
    with_flops,
)

__all__ = [
    "ACHIEVED_FRACTION",
    "ACHIEVED_MEMORY_FRACTION",
    "PROFILES",
    "DeviceProfile",
    "get_profile",
    "with_flops",
]
