"""A memory budget: a number of bytes, a size such as ``"20GiB"``, or ``"auto"``.

``offload_layers(model, memory_budget=...)`` and the integrations take one.  It is the
device memory the saved activations of a step may take, on top of what is allocated when
the step starts (parameters, gradients, optimizer state): the quantity the planner's
event model predicts (``PlanRow.peak_bytes``).

``"auto"`` is the device's free memory, as its runtime reports it, less a margin of
:data:`AUTO_MARGIN` (10%) for what the event model does not count (the temporaries of a
layer's forward and backward, the logits and the loss, the allocator's rounding), less
the gradients still to be allocated (parameters that require grad and hold none).  It is
read when the plan is made, at the start of the second step: after the first optimizer
step has allocated its state.  On the CPU the "device" is the host, whose available
memory is ``MemAvailable``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch

from ..device.backend import DeviceBackend

__all__ = [
    "AUTO",
    "AUTO_MARGIN",
    "REPLAN_MARGIN",
    "auto_budget",
    "free_device_memory",
    "parse_memory_budget",
    "said_budget",
    "size",
]

AUTO = "auto"
#: the fraction of the free device memory ``"auto"`` leaves unplanned
AUTO_MARGIN = 0.10
#: how far (a fraction of the budget) a step's measured peak of activations may exceed
#: the plan's prediction before the plan is made again, once
REPLAN_MARGIN = 0.10

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?")


def size(nbytes: float) -> str:
    """Bytes as a person reads them: ``"1.50 MiB"``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def said_budget(memory_budget: int | str) -> str:
    """A parsed ``memory_budget=`` as messages say it: ``'auto'`` or ``20.00 GiB``."""
    return "'auto'" if memory_budget == AUTO else size(int(memory_budget))


def parse_memory_budget(value: object, api: str) -> int | str:
    """``value`` as a number of bytes, or :data:`AUTO`.

    Args:
        value: an int (or a whole float) of bytes >= 0, a size string (``"20GiB"``,
            ``"512 MiB"``, ``"1.5GB"``: KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB
            of 1000, case ignored), or ``"auto"``.
        api: the function's name, for messages.

    Example:
        >>> parse_memory_budget("1.5GiB", "offload_layers"), parse_memory_budget(2**20, "f")
        (1610612736, 1048576)
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        match = _SIZE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"{api}: memory_budget={value!r} is not a size; give a number of bytes, a "
                "string such as '20GiB', '512MiB' or '1.5GB', or 'auto' (the device's free "
                "memory less a margin)."
            )
        return int(float(match[1]) * _UNITS[match[2] or "b"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{api}: memory_budget must be a number of bytes, a string such as '20GiB', or "
            f"'auto'; got {type(value).__name__} {value!r}."
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{api}: memory_budget must be a number of bytes >= 0, got {value!r}.")
    return int(value)


def free_device_memory(backend: DeviceBackend) -> int | None:
    """The device's free memory as its runtime reports it, plus what its caching
    allocator holds without using it (the blocks of the last step's activations); None
    where the runtime reports nothing."""
    free = backend.memory_available()
    if free is None:
        return None
    reserved, allocated = backend.memory_reserved(), backend.memory_allocated()
    if reserved is not None and allocated is not None:
        free += max(0, reserved - allocated)
    return free


def auto_budget(backend: DeviceBackend, parameters: Iterable[torch.Tensor]) -> int:
    """The bytes ``"auto"`` stands for now: free memory less :data:`AUTO_MARGIN` of it,
    less the gradients ``parameters`` will allocate (those that require grad and hold
    none)."""
    free = free_device_memory(backend) or 0
    coming = sum(
        p.numel() * p.element_size() for p in parameters if p.requires_grad and p.grad is None
    )
    return max(0, int(free * (1 - AUTO_MARGIN)) - coming)
