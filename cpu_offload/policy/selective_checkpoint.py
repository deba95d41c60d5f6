"""torch's selective activation checkpointing, with its CPU-offload policies honoured in eager.

:func:`create_selective_checkpoint_contexts` takes what torch's function of that name
takes and returns what it returns, the ``context_fn`` of non-reentrant
``torch.utils.checkpoint.checkpoint``.  Ops whose policy is ``MUST_SAVE`` or
``PREFER_SAVE`` are saved and ops whose policy is ``MUST_RECOMPUTE`` or
``PREFER_RECOMPUTE`` recomputed, by torch's own code; the outputs of ops whose policy is
``MUST_CPU_OFFLOAD`` or ``PREFER_CPU_OFFLOAD``, which torch recomputes in eager, are saved
and moved to the host on the schedule of the offloaded layer the checkpoint runs in.

NOTE [Offloaded outputs of a selective checkpoint]
    torch runs a selectively checkpointed function under two dispatch modes that share
    one cache: in forward a caching mode asks the policy about every op and caches the
    outputs of the ops to save (a ``_VersionWrapper`` of a detached alias, with its
    version); in the recompute a cached mode hands each cached entry back (its
    ``get_val``) instead of running the op.  The caching mode here is torch's,
    subclassed, and the cached mode is torch's own, so the cache's keys, the ops it
    ignores, its checks and errors, and what compile reads are torch's.

    An op whose policy is ``*_CPU_OFFLOAD`` is cached as ``PREFER_SAVE`` would be, and
    noted.  When the checkpointed forward ends (the caching mode is left) each tensor of
    each noted entry is handed to the pack hook of the offload context the checkpoint
    started in: the layer's ``push_tensor`` (or a chunk's), the hook that saved the
    checkpoint's inputs.  The cache then holds the hook's handle instead of the tensor,
    so the output belongs to the layer's push cycle: copied to the host with the
    layer's other tensors when the next layer starts, released and prefetched by the
    schedule, counted in the synchronizer's statistics, and handed back by the unpack
    hook (a fresh alias, as torch hands back a detached one) when the recompute
    reaches the op.  A tensor the layer keeps (under ``min_offload_numel``, not dense,
    marked) stays in the cache as it was.

    The in-place check is torch's: the entry keeps the version torch's cache recorded
    and a *version keeper* of the cached alias (its version counter, none of its
    memory), and the recompute raises torch's error when the version moved, unless
    ``allow_cache_entry_mutation``.

    Where an output cannot be moved exactly it is saved on the device, as
    ``PREFER_SAVE``, with one warning naming the op: outside an offloaded layer (no
    offload context is active, or the layer is not offloaded: the last layer never
    is), and under ``allow_cache_entry_mutation=True`` (an output changed in place after
    its copy started would come back without the change).  Saved, not recomputed as
    torch does in eager: the op runs once wherever the checkpoint runs, and its output
    gets the same in-place check, so a program computes and fails alike with offload
    on and off.  Under ``torch.compile`` (and export) the checkpoint is traced, with
    no real tensor to move: the function returns torch's own modes, and the compiler
    reads the policies from the graph as it does for torch's function.

NOTE [Choices finer than a layer]
    The offloaded outputs go through the saved-tensor hooks innermost where the
    checkpoint starts, when they are an offload context's (their unpack hook is
    ``handles.unpack_saved``).  A choice made for part of a layer (a submodule that
    keeps its tensors, or offloads them) that pushes a pack hook of its own, with that
    unpack hook, around the part is therefore obeyed by the checkpoints inside it too.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy

from ..engine.layer_data import version_keeper
from ..errors import CpuOffloadError
from ..hooks.autograd_hooks import is_cpu_offload_enabled
from ..hooks.handles import (
    Decomposed,
    SharedHandle,
    is_moved_handle,
    offload_hooks_on_top,
    unpack_saved,
)
from ..log import warn

__all__ = [
    "MUTATED",
    "OFFLOAD_POLICIES",
    "OffloadedOutput",
    "OffloadingCachingMode",
    "create_selective_checkpoint_contexts",
]

#: the policies whose outputs are moved to the host
OFFLOAD_POLICIES = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)
#: torch's words when a cached output was changed in place
MUTATED = "Tensor cached during selective activation checkpoint has been mutated"

_API = "cpu_offload.create_selective_checkpoint_contexts"
_CachingMode: Any = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
_storage_key: Any = getattr(torch_checkpoint, "_sac_storage_key", lambda func, args: func)
#: warnings given once per process, by reason
_warned: set[str] = set()
_TORCH_DIR = os.path.dirname(torch.__file__)


def _layout_known() -> bool:
    """Whether torch's selective checkpointing is built as this module expects: a cache
    of ``{key: {index: entry}}`` that the caching mode fills by a counter per key, and
    entries with ``val`` and ``version`` (torch 2.13)."""
    if _CachingMode is None:
        return False
    wrapper = getattr(torch_checkpoint, "_VersionWrapper", None)
    try:
        probe = _CachingMode(lambda *args, **kwargs: None, {})
        entry = wrapper(torch.empty(0)) if wrapper is not None else None
    except TypeError:
        return False
    return (
        hasattr(probe, "func_counter")
        and hasattr(probe, "storage")
        and hasattr(entry, "val")
        and hasattr(entry, "version")
    )


LAYOUT_KNOWN = _layout_known()
_TRACING_MODES = tuple(
    getattr(torch._C._TorchDispatchModeKey, name) for name in ("FAKE", "PROXY", "FUNCTIONAL")
)


def _tracing() -> bool:
    """Whether the checkpoint is being traced (torch.compile, export): its tensors are
    not real, and what becomes of them is the compiler's choice."""
    if torch.compiler.is_compiling():
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


class OffloadedOutput:
    """A cache entry whose tensor was handed to an offload context's pack hook (NOTE
    [Offloaded outputs of a selective checkpoint]); torch's cached mode calls
    :meth:`get_val` as it does on its own entries."""

    __slots__ = ("handle", "version", "keeper", "op")

    def __init__(self, handle: Any, version: int, keeper: torch.Tensor, op: Any) -> None:
        self.handle = handle
        self.version = version
        self.keeper = keeper  # shares the cached alias's version counter, no memory
        self.op = op

    def get_val(self, allow_cache_entry_mutation: bool) -> Any:
        """The cached output, back from the layer, after torch's in-place check."""
        if not allow_cache_entry_mutation and self.keeper._version != self.version:
            raise RuntimeError(
                f"{MUTATED} (cpu_offload: the output of {self.op} was offloaded with its "
                f"layer; it was at version {self.version} when cached and is at version "
                f"{self.keeper._version} now). Hint: find the in-place operation on this "
                "output after the op and make it out of place, or pass "
                "allow_cache_entry_mutation=True."
            )
        value = unpack_saved(self.handle)
        return value.detach() if isinstance(value, torch.Tensor) else value


class _Policy:
    """The user's policy as torch's caching mode asks it: an offload policy is answered
    ``PREFER_SAVE`` and noted for the mode."""

    __slots__ = ("policy", "noted")

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.noted: CheckpointPolicy | None = None

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy(ctx, func, *args, **kwargs)
        if policy in OFFLOAD_POLICIES:
            self.noted = policy
            return CheckpointPolicy.PREFER_SAVE
        return policy


_ModeBase: Any = _CachingMode if _CachingMode is not None else object


class OffloadingCachingMode(_ModeBase):  # type: ignore[misc]
    """torch's caching mode, whose ``*_CPU_OFFLOAD`` outputs go to the offload context
    the checkpoint started in (NOTE [Offloaded outputs of a selective checkpoint]).

    Args:
        policy_fn: the user's policy, as torch's function turned it into a function.
        storage: the cache it shares with the recompute's mode.
        allow_cache_entry_mutation: as torch's function takes it.
    """

    # Higher-order operators reach __torch_dispatch__ (torch's rules for them are
    # registered for its own class only, and do the same).
    supports_higher_order_operators = True

    def __init__(self, policy_fn: Any, storage: Any, allow_cache_entry_mutation: bool) -> None:
        super().__init__(_Policy(policy_fn), storage)
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        #: the offload context's (pack, unpack) hooks innermost where the checkpoint
        #: starts (NOTE [Choices finer than a layer]), or None
        self.offload_hooks = offload_hooks_on_top()
        #: (cache key, index, op, policy) of each output to move, in order
        self.noted: list[tuple[Any, int, Any, CheckpointPolicy]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        policy = self.policy_fn
        policy.noted = None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if policy.noted is not None:
            key = _storage_key(func, args)
            self.noted.append((key, self.func_counter[key] - 1, func, policy.noted))
            policy.noted = None
        return out

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        noted, self.noted = self.noted, []
        hooks, self.offload_hooks = self.offload_hooks, None
        if exc_type is None and noted:
            self._move(noted, hooks)

    def _move(self, noted: list[tuple[Any, int, Any, CheckpointPolicy]], hooks: Any) -> None:
        """Hand the noted outputs to the offload context's pack hook, or say why not."""
        _, _, op, policy = noted[0]
        if hooks is None:
            if is_cpu_offload_enabled():
                _warn_saved(
                    "not offloaded",
                    op,
                    policy,
                    "the checkpoint runs in a layer that is not offloaded (the last layer "
                    "never is, nor layers past the number offloaded; or another checkpoint "
                    "or other saved-tensor hooks are innermost)",
                    "Give the layer an offloading choice, or return a *_SAVE or "
                    "*_RECOMPUTE policy for this op there.",
                )
            else:
                _warn_saved(
                    "no context",
                    op,
                    policy,
                    "no offload context is active",
                    "Run the checkpoint inside a layer that offload_layers (or "
                    "get_cpu_offload_context) offloads.",
                )
            return
        if self.allow_cache_entry_mutation:
            _warn_saved(
                "mutation allowed",
                op,
                policy,
                "allow_cache_entry_mutation=True lets an output be changed in place after "
                "its copy to the host started, which the copy would miss",
                "Leave allow_cache_entry_mutation False to offload these outputs.",
            )
            return
        pack = hooks[0]
        storage = self.storage
        for key, index, op, _ in noted:
            entries = storage[key]
            entries[index] = tree_map(functools.partial(_pushed, pack=pack, op=op), entries[index])


def _pushed(cached: Any, *, pack: Any, op: Any) -> Any:
    """``cached`` (a torch cache entry) as an :class:`OffloadedOutput` once ``pack`` took
    its tensor to move it; itself when it holds no tensor, or one that stays."""
    tensor = getattr(cached, "val", None)
    if not isinstance(tensor, torch.Tensor) or cached.version is None:
        return cached
    handle = pack(tensor)
    if not (is_moved_handle(handle) or type(handle) in (Decomposed, SharedHandle)):
        return cached  # the layer keeps it on the device: so does the cache
    return OffloadedOutput(handle, cached.version, version_keeper(tensor), op)


def _warn_saved(reason: str, op: Any, policy: CheckpointPolicy, why: str, fix: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    frame, level = sys._getframe(0), 1  # the warning points at the user's checkpoint call
    while frame.f_back is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH_DIR)
    ):
        frame, level = frame.f_back, level + 1
    warn(
        f"{_API}: {op} has policy {policy.name}, but {why}, so its output is saved on the "
        f"device, as PREFER_SAVE would save it (and so are other such outputs there). {fix} "
        "This warning is shown once.",
        UserWarning,
        stacklevel=level,
    )


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Any, allow_cache_entry_mutation: bool = False
) -> tuple[Any, Any]:
    """torch's ``create_selective_checkpoint_contexts``, with ``*_CPU_OFFLOAD`` honoured.

    Use it as torch's, as the ``context_fn`` of non-reentrant checkpointing, inside a
    layer that cpu_offload offloads (``offload_layers``, ``get_cpu_offload_context``, or
    ``OffloadActivations``): outputs of ops whose policy is ``MUST_CPU_OFFLOAD`` or
    ``PREFER_CPU_OFFLOAD`` are saved and moved to the host with that layer's saved
    tensors (the copy overlaps the next layer, the reload is prefetched), and handed
    back to the recompute exactly; ``*_SAVE`` and ``*_RECOMPUTE`` mean what they mean
    to torch.  Outside an offloaded layer, and with ``allow_cache_entry_mutation=True``,
    such outputs are saved on the device, with one warning (NOTE [Offloaded outputs
    of a selective checkpoint]).

    Args:
        policy_fn_or_list: a policy function ``(ctx, op, *args, **kwargs) ->
            CheckpointPolicy`` (or a bool), or a list of ops to save (``MUST_SAVE``;
            every other op ``PREFER_RECOMPUTE``).
        allow_cache_entry_mutation: do not raise when a cached output was changed in
            place before the recompute took it.

    Returns:
        The forward's and the recompute's context managers.

    Raises:
        ValueError, TypeError: torch's, for a policy it does not take.
        CpuOffloadError: the installed torch builds selective checkpointing otherwise
            than this function knows (it was written against torch 2.13).

    Example (a whole model in docs/usage.md, "Selective checkpointing with offload"):
        >>> import functools, torch
        >>> from torch.utils.checkpoint import CheckpointPolicy, checkpoint
        >>> from cpu_offload import create_selective_checkpoint_contexts
        >>> def policy(ctx, op, *args, **kwargs):
        ...     if op is torch.ops.aten.mm.default:
        ...         return CheckpointPolicy.MUST_CPU_OFFLOAD
        ...     return CheckpointPolicy.PREFER_RECOMPUTE
        >>> context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        >>> def layer(h):  # run it inside an offloaded layer
        ...     return checkpoint(lambda t: (t @ t).sin(), h, use_reentrant=False,
        ...                       context_fn=context_fn)
        >>> [type(mode).__name__ for mode in context_fn()]
        ['OffloadingCachingMode', '_CachedTorchDispatchMode']
    """
    caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(
        policy_fn_or_list, allow_cache_entry_mutation
    )
    if _tracing():
        return caching, cached  # the compiler reads the policies from the traced graph
    if not LAYOUT_KNOWN:
        raise CpuOffloadError(
            f"{_API}: torch {torch.__version__} builds selective checkpointing otherwise "
            "than this function expects (it was written against torch 2.13: a caching mode "
            "with a counter per op, entries with val and version). Use "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts on this torch "
            "(it recomputes *_CPU_OFFLOAD ops in eager), or upgrade torch."
        )
    mode = OffloadingCachingMode(caching.policy_fn, caching.storage, allow_cache_entry_mutation)
    return mode, cached
