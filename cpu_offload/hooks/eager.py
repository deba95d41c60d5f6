"""The offloader's code runs eagerly, never traced or compiled by dynamo.

NOTE [Hooks around compiled code]
    A compiled region's runtime calls our pack and unpack hooks with dynamo's frame
    callback installed, so dynamo would try to compile them as frames of their own;
    compiled autograd traces the backward pre-hook that ``sync_fn`` registers; and a
    compiled model that calls our context or ``sync_fn`` would trace them.  They
    move tensors between streams and must run as written.  Wrapping each hook in
    ``torch.compiler.disable`` does that at a cost on every saved tensor (two calls
    that switch the frame callback off and on).  Instead the modules the hooks run
    through are put on dynamo's list of files it skips (``trace_rules.add``): their
    frames are never compiled, and a traced call into them is a graph break that runs
    eagerly, at no cost per call.  Where that list cannot be extended (a PyTorch
    without it), :func:`eager` falls back to ``torch.compiler.disable``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["SKIPPED", "eager"]

F = TypeVar("F", bound=Callable)

#: the modules a pack, unpack or backward hook runs through (not ``context``:
#: ``start_offload`` called in a compiled function is traced, and does nothing there)
_HOOK_MODULES = (
    "cpu_offload.engine.backward_hook",
    "cpu_offload.engine.chunk_engine",
    "cpu_offload.chunked",
    "cpu_offload.report.copy_timer",
    "cpu_offload.device.runtime",
    "cpu_offload.engine.offload_engine",
    "cpu_offload.engine.forward_pass",
    "cpu_offload.engine.host_buffers",
    "cpu_offload.engine.layer_data",
    "cpu_offload.engine.layer_state",
    "cpu_offload.engine.manual_synchronizer",
    "cpu_offload.engine.pass_schedule",
    "cpu_offload.log",
    "cpu_offload.hooks.marks",
    "cpu_offload.policy.measured_step",
    "cpu_offload.hooks.per_thread",
    "cpu_offload.policy.planned_synchronizer",
    "cpu_offload.policy.reentrant_checkpoint",
    "cpu_offload.policy.other_offloaders",
    "cpu_offload.report.profiler_ranges",
    "cpu_offload.hooks.selection",
    "cpu_offload.policy.selective_checkpoint",
    "cpu_offload.report.stats",
    "cpu_offload.report.step_record",
    "cpu_offload.report.step_report",
    "cpu_offload.engine.synchronizer",
    "cpu_offload.hooks.tensor_group",
    "cpu_offload.engine.transitions",
)


def _skip_in_dynamo() -> bool:
    try:
        from torch._dynamo import trace_rules

        for name in _HOOK_MODULES:
            trace_rules.add(name)
    except (ImportError, AttributeError, TypeError, AssertionError):
        return False
    return True


#: whether dynamo skips the hook modules (else :func:`eager` wraps)
SKIPPED = _skip_in_dynamo()


def eager(function: F) -> F:
    """``function`` as it is where dynamo skips its module, else compiler-disabled."""
    return function if SKIPPED else torch.compiler.disable(function)
