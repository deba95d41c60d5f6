"""What a pack hook returns, and the unpack hook that turns it back into a tensor.

NOTE [Handles]
    What the pack hook returns, and autograd holds until the unpack hook, is built
    once per saved tensor, so it is a plain tuple (a tuple costs a fifth of an object
    with an ``__init__``):
        ``(lease, index)``          a tensor the layer may copy: its lease and position;
        ``(tensor, version, layer)`` a tensor that stays where it is, without history,
                                    and its version at push (checked at unpack).
    Anything else the hook may return is an object of its own class (:class:`Decomposed`,
    :class:`Verbatim`, :class:`SharedHandle`) or an object pushed by hand that is no
    tensor (itself), never a tuple.

NOTE [Lifetime of a layer's data]
    The handles a pack hook returns share one :class:`Lease` per layer and push
    cycle; autograd holds the handles as long as the graph may still unpack them.
    When the last handle dies (backward freed its saved tensors, or the graph was
    dropped) the lease's finalizer waits for copies in flight and gives the host
    buffers back to the pool.  Until then the host copies stay: after its backward
    a layer drops its device tensors but keeps its host copies, so a second
    backward through the same graph (``retain_graph=True``, ``create_graph=True``)
    reloads it again.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .autograd_hooks import top_saved_tensor_hooks
from .eager import eager

__all__ = [
    "Decomposed",
    "Layer",
    "Lease",
    "SharedHandle",
    "Verbatim",
    "describe",
    "is_moved_handle",
    "kept_handle",
    "modified_error",
    "unpack_saved",
    "verbatim",
]


class Layer(Protocol):
    """What a handle asks of the layer state that made it (``layer_state.py``)."""

    name: str

    def pop_leased(self, lease: Lease, index: int, prefetch: bool = True) -> torch.Tensor: ...


class Lease:
    """Shared by the handles of one layer's push cycle; see NOTE [Lifetime of a layer's data]."""

    __slots__ = ("layer", "__weakref__")

    def __init__(self, layer: Layer) -> None:
        self.layer = layer


def kept_handle(tensor: torch.Tensor, layer: Layer) -> tuple:
    """The handle of a tensor that stays: an output saved by its own node would hold
    that node, so it is held without history (NOTE [Saved tensors without their
    history] in layer_state.py; ``is_leaf`` is False exactly when there is a ``grad_fn``)."""
    return (tensor if tensor.is_leaf else tensor.detach(), tensor._version, layer)


def is_moved_handle(handle: object) -> bool:
    """Whether ``handle`` (a pack hook's result) stands for a tensor the layer may copy."""
    return type(handle) is tuple and len(handle) == 2


class Verbatim:
    """A tuple pushed by hand, wrapped: a handle that is a tuple means a tensor."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def verbatim(obj: Any) -> Any:
    """The handle of an object pushed that is no tensor: the object itself (unless a tuple)."""
    return Verbatim(obj) if isinstance(obj, tuple) else obj


class SharedHandle:
    """A handle to a tensor that another save already handed to a layer (NOTE [A tensor
    saved in several chunks] in chunked.py): it unpacks that tensor without starting
    the layer's first-pop prefetch."""

    __slots__ = ("lease", "index")

    def __init__(self, lease: Lease, index: int) -> None:
        self.lease = lease
        self.index = index


class Decomposed:
    """What the pack hook returns for an object saved as its components (see
    ``saving_protocol.py``): the components' handles and the emptied object."""

    __slots__ = ("parts", "obj")

    def __init__(self, parts: list[Any], obj: Any) -> None:
        self.parts = parts
        self.obj = obj


def modified_error(tensor_desc: str, found: int, expected: int, where: str) -> RuntimeError:
    """Autograd's error for a saved tensor modified in place, with where it happened."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{tensor_desc}] is at version {found}; expected version "
        f"{expected} instead. (cpu_offload: {where}.) Hint: find the in-place operation "
        "on this tensor after it was saved and make it out of place."
    )


def describe(tensor: torch.Tensor) -> str:
    """A tensor as autograd's messages name it."""
    return f"{tensor.type()} {list(tensor.shape)}"


@eager
def unpack_saved(handle: Any) -> Any:
    """The unpack hook: turn whatever a pack hook returned back into a tensor."""
    if type(handle) is tuple:  # NOTE [Handles]
        if len(handle) == 2:
            lease, index = handle
            return lease.layer.pop_leased(lease, index)
        tensor, version, layer = handle
        if tensor._version != version:
            raise modified_error(
                describe(tensor),
                tensor._version,
                version,
                f"the tensor was saved by {layer.name} and stayed on the device",
            )
        return tensor
    if type(handle) is SharedHandle:
        return handle.lease.layer.pop_leased(handle.lease, handle.index, False)
    if type(handle) is Decomposed:
        components = [None if part is None else unpack_saved(part) for part in handle.parts]
        handle.obj.restore_from_saved(components)
        return handle.obj
    if type(handle) is Verbatim:
        return handle.obj
    return handle


def offload_hooks_on_top() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks ``(pack, unpack)`` of this thread when they are an
    offload context's (their unpack is :func:`unpack_saved`), else None: not offloaded,
    under a checkpoint's own hooks, recomputing."""
    top = top_saved_tensor_hooks()
    return top if top is not None and top[1] is unpack_saved else None
