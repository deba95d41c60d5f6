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
    eagerly, at no cost per call.  ``import cpu_offload`` does not import dynamo (it
    doubles the import's time): the modules go on the list when ``torch._dynamo`` is
    imported (a finder on ``sys.meta_path`` runs :func:`skip_in_dynamo` after it), or
    at once where it already is.  The module hooks themselves stay traceable (a whole
    model compiled traces them, as no-ops, with no graph break), but a layer compiled in
    place runs ``nn.Module._call_impl``, a file dynamo skips, with its frame callback on:
    each hook it calls would be compiled as a frame of its own, one cache entry per hook
    object, every entry's guards checked at each call.  The hooks' code is marked to run
    as written at the top of a frame (``set_code_exec_strategy``), with what it calls.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["eager", "skip_in_dynamo"]

F = TypeVar("F", bound=Callable)

#: the modules a pack, unpack or backward hook runs through (not ``context``:
#: ``start_offload`` called in a compiled function is traced, and does nothing there)
_HOOK_MODULES = (
    "cpu_offload.engine.backward_hook",
    "cpu_offload.chunked",
    "cpu_offload.report.copy_timer",
    "cpu_offload.device.runtime",
    "cpu_offload.device.pinned_sizes",
    "cpu_offload.engine.offload_engine",
    "cpu_offload.engine.forward_pass",
    "cpu_offload.engine.host_buffers",
    "cpu_offload.engine.layer_data",
    "cpu_offload.engine.layer_state",
    "cpu_offload.engine.manual_synchronizer",
    "cpu_offload.engine.pass_schedule",
    "cpu_offload.log",
    "cpu_offload.hooks.graph_ops",
    "cpu_offload.hooks.marks",
    "cpu_offload.policy.measured_step",
    "cpu_offload.hooks.per_thread",
    "cpu_offload.policy.planned_synchronizer",
    "cpu_offload.policy.reentrant_checkpoint",
    "cpu_offload.policy.reentrant_budget",
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


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Puts the hook modules on dynamo's skip list once ``torch._dynamo`` is imported
    (NOTE [Hooks around compiled code]); ``import cpu_offload`` does not import it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        _remove_finder()
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _SkipAfterLoad(spec.loader)
        return spec


class _SkipAfterLoad(importlib.abc.Loader):
    """``torch._dynamo``'s own loader, then :func:`skip_in_dynamo`."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        skip_in_dynamo()


_finder = _AfterDynamoImport()


def _remove_finder() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def skip_in_dynamo() -> None:
    """Put the hook modules on dynamo's list of files it does not trace (once dynamo is
    imported; idempotent)."""
    from torch._dynamo import trace_rules

    for name in _HOOK_MODULES:
        trace_rules.add(name)
    _skip_hook_frames()


def _skip_hook_frames() -> None:
    """Module hooks run as frames of their own, never compiled (NOTE [Hooks around
    compiled code]): a layer compiled in place runs ``nn.Module._call_impl``, a file
    dynamo skips, with its frame callback on, so each hook it calls would be compiled
    as a frame (one cache entry per hook object, each entry's guards checked at every
    call).  Their code is marked to run as written, with what it calls; a hook that a
    compiled frame calls is still traced (a whole model compiled: no graph break)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # another torch: the hooks' frames are compiled, as before
        return
    from .module_hooks import ModuleHook, PassThrough

    as_written = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for code in (ModuleHook.__call__.__code__, PassThrough.__call__.__code__):
        set_code_exec_strategy(code, as_written)


if "torch._dynamo" in sys.modules:
    skip_in_dynamo()
else:
    sys.meta_path.insert(0, _finder)


def eager(function: F) -> F:
    """``function`` itself: its module is on dynamo's skip list, so dynamo never traces
    it (a traced call into it is a graph break that runs it eagerly)."""
    return function
