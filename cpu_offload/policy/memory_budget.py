"""A memory budget: a number of bytes, a size such as ``"20GiB"``, or ``"auto"``.

``offload_layers(model, memory_budget=...)`` and the integrations take one.  It is the
device memory the saved activations of a step may take, on top of what is allocated when
the step starts (parameters, gradients, optimizer state): the quantity the planner's
event model predicts (``PlanRow.peak_bytes``).

``"auto"`` is the device's free memory, as its runtime reports it, less a margin of
:data:`AUTO_MARGIN` (10%) for what the event model does not count (the temporaries of a
layer's forward and backward, the logits and the loss, the allocator's rounding), less
the gradients still to be allocated (parameters that require grad and hold none).  On the
CPU the "device" is the host, whose available memory is ``MemAvailable``.

NOTE [When "auto" is read]
    Free memory is what is left once the optimizer's state exists, which its first
    step allocates.  So ``"auto"`` is read when a forward pass starts after the measured
    step and after the first step of a ``torch.optim`` optimizer (a global step post
    hook, ``torch.optim.optimizer.register_optimizer_step_post_hook``, watches for one
    whose parameters include the model's).  With gradient accumulation the micro-batches
    before that step run as the measured one did (nothing offloaded); a plan is made at
    the first micro-batch after it.  An optimizer that is not a ``torch.optim``
    optimizer never says it stepped: after a few passes without a plan, a warning says
    to give the budget in bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..device.amounts import AUTO, FORMS, parse_bytes, size
from ..device.backend import DeviceBackend

__all__ = [
    "AUTO",
    "AUTO_MARGIN",
    "REPLAN_MARGIN",
    "auto_budget",
    "free_device_memory",
    "gradients_to_come",
    "parse_memory_budget",
    "said_budget",
    "size",
]

#: the fraction of the free device memory ``"auto"`` leaves unplanned
AUTO_MARGIN = 0.10
#: how far (a fraction of the budget) a step's measured peak of activations may exceed
#: the plan's prediction before the plan is made again, once
REPLAN_MARGIN = 0.10


def said_budget(memory_budget: int | str) -> str:
    """A parsed ``memory_budget=`` as messages say it: ``'auto'`` or ``20.00 GiB``."""
    return "'auto'" if memory_budget == AUTO else size(int(memory_budget))


def parse_memory_budget(value: object, api: str) -> int | str:
    """``value`` as a number of bytes, or :data:`AUTO`.

    Args:
        value: an amount of memory (:func:`cpu_offload.device.amounts.parse_bytes`: bytes as an
            int of at least 1 MiB, or a size string such as ``"20GiB"``), or ``"auto"``.
        api: the function's name, for messages.

    Example:
        >>> parse_memory_budget("1.5GiB", "offload_layers"), parse_memory_budget(2**20, "f")
        (1610612736, 1048576)
    """
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    budget = parse_bytes(value, "memory_budget", api, forms=f"{FORMS}, or 'auto'")
    if budget == 0:
        raise ValueError(
            f"{api}: memory_budget={value!r} is 0 bytes for saved activations, which no "
            "policy can meet (a layer's activations are on the device during its "
            "backward). For as much offload as the planner finds, give a small budget "
            "such as '1GiB' (the closest policy runs, with a warning); for a fixed number of "
            "offloaded layers, pass num_layers instead."
        )
    return budget


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
    return max(0, int(free * (1 - AUTO_MARGIN)) - gradients_to_come(parameters))


def gradients_to_come(parameters: Iterable[torch.Tensor]) -> int:
    """The bytes of the gradients a backward may allocate: of ``parameters`` that require
    grad and hold none."""
    return sum(
        p.numel() * p.element_size() for p in parameters if p.requires_grad and p.grad is None
    )
