"""Saved tensors handed to the offloader by ops inside a compiled layer's graphs.

NOTE [Copies as graph ops]
    AOTAutograd inlines saved-tensor hooks that are ``torch.fx.GraphModule`` s: the
    pack hook's graph becomes the compiled forward's epilogue (once per saved
    intermediate), the unpack hook's graph the compiled backward's prologue, and the
    compiled call runs with the eager hooks off.  With ``compiled_copies="graph_ops"``
    (opt-in: the eager hooks move the layers' inputs too, for less host cost), a
    compiled layer entered for offload (NOTE [Compiled layers]) pushes :data:`PACK` and
    :data:`UNPACK` above the layer's own eager hooks while its compiled call runs:

    * ``cpu_offload::offload_saved(t) -> token`` hands ``t`` to the layer state whose
      pack hook is underneath (:class:`GraphOps`), and returns an empty token that
      carries the handle; autograd saves the token, not ``t``;
    * ``cpu_offload::reload_saved(token, size, stride, dtype, device) -> t`` gives back
      what the layer's schedule prefetched (the unpack hook, :func:`unpack_saved`).

    The engine stays the scheduler: what moves, when it is copied, released and
    reloaded is decided as for an eager layer.  Both ops are opaque to the compilers.

    Inductor plans the buffers of its graph: once ``offload_saved`` has read ``t``
    (its last reader now that ``t`` is no graph output) it frees the buffer or reuses
    it for a later kernel, or writes another result into it in place, and it may
    schedule the op early to lower the peak.  A copy made later from memory inductor
    has reused would be wrong.  So the op hands the layer state a device copy of ``t``
    made on the current stream (``clone``: ordered before any later kernel, and owned
    by the offloader alone): the buffer inductor plans is free to reuse as soon as the
    op returns, and the layer's copy to the host, its release and its reload run on
    the layer's schedule from that clone.  The price is one device-to-device copy per
    saved tensor (device memory bandwidth, an order of magnitude above the host
    link's) and at most one extra tensor alive at a time inside the graph (``t`` goes
    once the op has read it).  The tensor the reload op returns is the graph's own:
    where the layer keeps holding what it hands back (a tensor kept on the device, a
    layer not yet copied), the op returns a clone of it, since inductor may write into
    the op's output once its last reader ran.

    The keep-or-move decision is static per compiled graph: the ops are in a graph
    only when it was compiled with :data:`PACK`/:data:`UNPACK` on top of the hooks,
    which happens when the layer is offloaded (its schedule's choice at the call).
    Dynamo guards each compiled graph on the identity of the hooks on top
    (``AUTOGRAD_SAVED_TENSORS_HOOKS``): a layer whose choice changes (kept now, or
    offload turned off) gets the graph compiled without them, a recompile that dynamo
    counts as any other.  Which saved tensors reach the op is AOTAutograd's choice
    (``torch._functorch.config.saved_tensors_hooks_filtering_mode``): with its default,
    ``"donated"``, the intermediates only, which no user code can see; the layer's
    inputs and weights are saved as they are.  Under another mode, or a torch without
    this inlining, the layer keeps the eager hooks around its compiled call
    (:func:`available`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ..errors import CpuOffloadError
from .eager import eager
from .handles import is_moved_handle, unpack_saved
from .per_thread import PerThread

__all__ = ["PACK", "UNPACK", "GraphOps", "available", "graph_ops", "set_pack_hook"]


class GraphOps:
    """How many tensors went through the ops, in this process."""

    __slots__ = ("packed", "reloaded")

    def __init__(self) -> None:
        #: tensors handed to the offloader by ``offload_saved``
        self.packed = 0
        #: tensors given back by ``reload_saved``
        self.reloaded = 0


class _Pack:
    """Per thread: the pack hook that :data:`PACK`'s op calls (the layer state's, for
    the compiled call in progress), or None."""

    __slots__ = ("hook",)

    def __init__(self) -> None:
        self.hook: Callable[[torch.Tensor], Any] | None = None


_counts = GraphOps()
_pack_hook: PerThread[_Pack] = PerThread(_Pack)


def graph_ops() -> GraphOps:
    """The counts of the tensors that went through the ops."""
    return _counts


def set_pack_hook(hook: Callable[[torch.Tensor], Any] | None) -> bool:
    """Set this thread's pack hook for the ops; whether one was set before."""
    slot = _pack_hook.value
    previous = slot.hook
    slot.hook = hook
    return previous is not None


_lib = torch.library.Library("cpu_offload", "FRAGMENT")
_lib.define("offload_saved(Tensor tensor) -> Tensor")
_lib.define(
    "reload_saved(Tensor token, SymInt[] size, SymInt[] stride, ScalarType dtype, "
    "Device device) -> Tensor"
)

_EMPTY = torch.empty(0)


@eager
def _offload_saved(tensor: torch.Tensor) -> torch.Tensor:
    pack = _pack_hook.value.hook
    if pack is None:
        raise CpuOffloadError(
            "cpu_offload::offload_saved ran outside a compiled layer entered for offload: "
            "expected the layer's offload hooks around the call, found none (a graph "
            "compiled with them was called without them). Call the layer through its "
            "module, whose offload entry pushes them, or compile it again after "
            "torch._dynamo.reset()."
        )
    _counts.packed += 1
    token = _EMPTY.detach()  # no view: AOTAutograd would save a detached view
    token.handle = pack(tensor.clone())  # type: ignore[attr-defined]
    return token


@eager
def _reload_saved(
    token: torch.Tensor, size: Any, stride: Any, dtype: Any, device: Any
) -> torch.Tensor:
    handle = token.handle  # type: ignore[attr-defined]
    tensor = unpack_saved(handle)
    _counts.reloaded += 1
    if not is_moved_handle(handle) or tensor.stride() != tuple(stride):
        # held by the layer still (kept), or not of the layout the graph was compiled for
        out = torch.empty_strided(size, stride, dtype=dtype, device=device)
        return out.copy_(tensor)
    return tensor


def _fake_offload(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0)


def _fake_reload(token: torch.Tensor, size: Any, stride: Any, dtype: Any, device: Any) -> Any:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


_lib.impl("offload_saved", _offload_saved, "CompositeExplicitAutograd")
_lib.impl("reload_saved", _reload_saved, "CompositeExplicitAutograd")
torch.library.register_fake("cpu_offload::offload_saved", _fake_offload, lib=_lib)
torch.library.register_fake("cpu_offload::reload_saved", _fake_reload, lib=_lib)
_lib.impl("offload_saved", _offload_saved, "Meta")
_lib.impl("reload_saved", _reload_saved, "Meta")


def _pack(tensor: torch.Tensor) -> Any:
    token = torch.ops.cpu_offload.offload_saved.default(tensor)
    return (token, tensor.size(), tensor.stride(), tensor.dtype, tensor.device)


def _unpack(packed: Any) -> torch.Tensor:
    return torch.ops.cpu_offload.reload_saved.default(
        packed[0], packed[1], packed[2], packed[3], packed[4]
    )


#: the pack hook inlined into a compiled forward (one object: dynamo guards on its identity)
PACK: fx.GraphModule = fx.symbolic_trace(_pack)
#: the unpack hook inlined into a compiled backward
UNPACK: fx.GraphModule = fx.symbolic_trace(_unpack)


def available() -> bool:
    """Whether compiled layers take their saved tensors through the ops: this torch
    inlines graph-module hooks, and its filtering mode is ``"donated"``."""
    config = getattr(torch._functorch, "config", None)
    mode = getattr(config, "saved_tensors_hooks_filtering_mode", None)
    return mode == "donated"
