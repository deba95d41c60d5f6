"""A layer's forward under non-reentrant activation checkpointing, as a policy applies it.

``checkpoint_forward(module, ...)`` makes ``module.forward`` an instance attribute, a
:class:`CheckpointedForward`, until every handle that asked for it gave it up.  What the
wrapper keeps of its host library's contract:

- every keyword argument reaches the layer unchanged, whatever its name (a layer's
  ``debug`` or ``use_reentrant`` is not ``torch.utils.checkpoint``'s);
- a layer given a Hugging Face cache runs without it, as under transformers' gradient
  checkpointing: its recompute in backward would append to the cache a second time
  (NOTE [A cache under a checkpointed layer]);
- a copy of the module (``copy.deepcopy``, ``torch.save``) carries no wrapper and no
  reference cycle (NOTE [Copies of a checkpointed module]).
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import CpuOffloadError
from ..log import warn

__all__ = ["CACHE_ARGUMENTS", "CheckpointedForward", "Checkpointing", "checkpoint_forward"]

#: where a Hugging Face layer takes its cache (transformers 5, 4, and older GPT-2 names)
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")

# NOTE [Checkpoint inside the offload context]
# Non-reentrant checkpointing saves the tensors its function receives (through the
# saved-tensor hooks active when it starts) and pushes its own hooks for everything the
# function saves, which it drops and recomputes in backward.  offload_layers enters the
# offload context in the layer's forward pre-hook, before ``forward`` runs, and the
# checkpoint is inside ``forward``: the checkpoint's inputs are the only tensors of the
# layer the offloader sees.  Recomputation calls the original forward, not the module,
# so it runs no offload hooks, and what it saves goes to the checkpoint's hooks.  The
# layer's keyword arguments are bound to the forward it checkpoints (a partial), not
# passed through the checkpoint's own keywords and not saved: a Hugging Face layer's
# ``position_embeddings`` (shared by every layer) are not copied once per layer, and
# only positional tensors (the hidden states) are offloaded.

# NOTE [A cache under a checkpointed layer]
# A Hugging Face decoder layer given a cache appends its keys and values to it.  Under a
# checkpoint the layer runs twice, once in forward and once in backward, and the
# recompute would append them again: the cache doubles and, with a padding mask, the
# recompute fails on a shape.  transformers' own gradient checkpointing turns the cache
# off for a checkpointed layer (``use_cache=False``, the cache argument ``None``) and
# says so once; so does the wrapper, by the same argument names, passed by keyword or by
# position (GPT-2 passes its cache positionally), unless the layer's class says it only
# reads the cache (``_can_checkpoint_with_cache``).  Only when the checkpoint runs: with
# gradients off (generation) the layer uses its cache as usual.  The model still returns
# its cache, without entries for the checkpointed layers.

# NOTE [Copies of a checkpointed module]
# The wrapper is an instance attribute, which ``copy.deepcopy`` and pickling copy with
# the module's ``__dict__``.  While a module is wrapped, an instance ``__getstate__``
# (which both consult) gives its state without the wrapper and without itself, so a
# copy runs the class's forward (or the instance forward the wrapper shadowed) and holds
# nothing of ours.  The wrapper holds its module weakly: no reference cycle through the
# instance attribute, so a model is freed by reference counting.


class Checkpointing:
    """One handle's request to checkpoint a module; :meth:`remove` withdraws it.

    Attributes:
        wrapper: the module's :class:`CheckpointedForward`.
        enabled: while it says False, this request does not checkpoint.
        position: the module's (first) position in the handle's layers, for messages.
        warned: what the handle has warned about already (shared by its requests).
        on_recompute: called each time a checkpoint this request made recomputes the
            module in backward (the handle's step report), or None.
    """

    def __init__(
        self,
        wrapper: CheckpointedForward,
        enabled: Callable[[], bool],
        position: int,
        warned: set[str],
    ) -> None:
        self.wrapper = wrapper
        self.enabled = enabled
        self.position = position
        self.warned = warned
        self.on_recompute: Callable[[], None] | None = None

    def remove(self) -> None:
        self.wrapper.release(self)

    def cache_dropped(self, module: nn.Module, dropped: list[str]) -> None:
        """Say once per handle that a checkpointed layer runs without its cache."""
        if "cache" in self.warned:
            return
        self.warned.add("cache")
        warn(
            f"cpu_offload: offload_layers checkpoints layer {self.position} "
            f"({type(module).__name__}), which was called with {_listed(dropped)}. "
            "Its recompute in backward would append to the cache a second time, so "
            "checkpointed layers run without the cache, as under transformers' gradient "
            "checkpointing: the cache the model returns has no entries for them. Pass "
            "use_cache=False when training (or set model.config.use_cache = False) to "
            "leave the cache out. This warning is shown once per offload_layers handle.",
            UserWarning,
            stacklevel=4,
        )


class CheckpointedForward:
    """Runs a module's forward under non-reentrant activation checkpointing (as an
    instance attribute that shadows the class's ``forward``) while a handle asks for it.

    Made by :func:`checkpoint_forward`; one per module, shared by the handles that
    checkpoint it, and removed (the module's forward restored) when the last of them
    gives it up, in whatever order.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)  # NOTE [Copies of a checkpointed module]
        self.shadowed = module.__dict__.get("forward")  # another wrapper's, if any
        self.shadowed_getstate = module.__dict__.get("__getstate__")
        self.requests: list[Checkpointing] = []
        self.getstate = _StateWithoutWrapper(self)
        self._positions: tuple[Any, dict[str, int]] = (None, {})
        module.forward = self  # type: ignore[method-assign]
        module.__getstate__ = self.getstate  # type: ignore[method-assign]

    def _alive(self) -> nn.Module:
        module = self.module()
        if module is None:  # pragma: no cover - its caller holds it
            raise CpuOffloadError(
                "cpu_offload: a checkpoint wrapper outlived its module; please report this bug."
            )
        return module

    def _inner(self, module: nn.Module) -> Callable[..., Any]:
        """The forward this wrapper checkpoints: the one it shadowed, or the class's."""
        if self.shadowed is not None:
            return self.shadowed  # type: ignore[no-any-return]
        return _class_forward(module)

    def checkpoints_now(self) -> bool:
        """Whether a call now would checkpoint (a request is enabled, grad is on)."""
        return torch.is_grad_enabled() and any(r.enabled() for r in self.requests)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._alive()
        forward = self._inner(module)
        request = next((r for r in self.requests if r.enabled()), None)
        if request is None or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args, kwargs, dropped = self._without_cache(module, forward, args, kwargs)
        if dropped:
            request.cache_dropped(module, dropped)
        # The layer's keyword arguments are bound here, not passed through checkpoint's
        # own keywords (debug, use_reentrant, ...): NOTE [Checkpoint inside the offload
        # context].
        function: Callable[..., Any] = functools.partial(forward, **kwargs)
        if request.on_recompute is not None:
            function = _SaysWhenRecomputed(function, request.on_recompute)
        return checkpoint(function, *args, use_reentrant=False)

    def _without_cache(
        self,
        module: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
        """``args`` and ``kwargs`` with caching off; what was turned off, for the warning.

        NOTE [A cache under a checkpointed layer]
        """
        names: tuple[str, ...] = ("use_cache",)
        if not getattr(module, "_can_checkpoint_with_cache", False):
            names += CACHE_ARGUMENTS
        positions = self._positions_of(forward)
        arguments, dropped = list(args), []
        for name in names:
            off: Any = False if name == "use_cache" else None
            position = positions.get(name, len(arguments))
            if name in kwargs:
                value = kwargs[name]
            elif position < len(arguments):
                value = arguments[position]
            else:
                continue
            if value is None or value is False:
                continue
            if name in kwargs:
                kwargs[name] = off  # the call's own dict
            else:
                arguments[position] = off
            dropped.append(f"{name}={value!r}" if name == "use_cache" else f"a cache in {name}")
        return tuple(arguments), kwargs, dropped

    def _positions_of(self, forward: Callable[..., Any]) -> dict[str, int]:
        """Where the cache arguments sit among ``forward``'s positional parameters."""
        function = getattr(forward, "__func__", forward)
        if self._positions[0] is not function:
            positions: dict[str, int] = {}
            try:
                parameters = list(inspect.signature(forward).parameters.values())
            except (TypeError, ValueError):  # no signature: keyword arguments only
                parameters = []
            for index, parameter in enumerate(parameters):
                if parameter.kind not in (
                    parameter.POSITIONAL_ONLY,
                    parameter.POSITIONAL_OR_KEYWORD,
                ):
                    break
                positions[parameter.name] = index
            self._positions = (function, positions)
        return self._positions[1]

    def release(self, request: Checkpointing) -> None:
        """Withdraw ``request``; the last one gives the module its forward back (unless
        something wrapped ours since: then ours passes through)."""
        if request in self.requests:
            self.requests.remove(request)
        module = self.module()
        if self.requests or module is None:
            return
        if module.__dict__.get("forward") is self:
            if self.shadowed is None:
                del module.forward
            else:
                module.forward = self.shadowed  # type: ignore[method-assign]
        if module.__dict__.get("__getstate__") is self.getstate:
            if self.shadowed_getstate is None:
                del module.__getstate__
            else:
                module.__getstate__ = self.shadowed_getstate  # type: ignore[method-assign]

    # Reached only when a wrapper of someone else's, set after ours, holds ours and is
    # copied with the module: the copy gets the forward ours shadowed.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.shadowed is not None:
            return copy.deepcopy(self.shadowed, memo)
        module = self._alive()
        return _class_forward(memo.get(id(module), module))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.shadowed is not None:
            return _same, (self.shadowed,)
        return _class_forward, (self._alive(),)


class _StateWithoutWrapper:
    """A checkpointed module's ``__getstate__``: its state without our attributes.

    NOTE [Copies of a checkpointed module]
    """

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: CheckpointedForward) -> None:
        self.wrapper = wrapper

    def __call__(self) -> Any:
        wrapper = self.wrapper
        if wrapper.shadowed_getstate is not None:
            state = wrapper.shadowed_getstate()
        else:
            module = wrapper._alive()
            state = getattr(type(module), "__getstate__")(module)  # noqa: B009
        if isinstance(state, dict):
            state = dict(state)
            for name, mine, before in (
                ("forward", wrapper, wrapper.shadowed),
                ("__getstate__", self, wrapper.shadowed_getstate),
            ):
                if state.get(name) is mine:
                    if before is None:
                        del state[name]
                    else:
                        state[name] = before
        return state


class _SaysWhenRecomputed:
    """The function a checkpoint runs: its first call is the forward, every later one a
    recompute in backward, which it reports."""

    __slots__ = ("function", "on_recompute", "calls")

    def __init__(self, function: Callable[..., Any], on_recompute: Callable[[], None]) -> None:
        self.function = function
        self.on_recompute = on_recompute
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            self.on_recompute()
        return self.function(*args)


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _class_forward(module: nn.Module) -> Any:
    return types.MethodType(type(module).forward, module)


def _same(value: Any) -> Any:
    return value


def checkpoint_forward(
    module: nn.Module,
    enabled: Callable[[], bool],
    position: int,
    warned: set[str],
    on_recompute: Callable[[], None] | None = None,
) -> Checkpointing:
    """Checkpoint ``module``'s forward until the returned request is removed;
    ``on_recompute()`` is called at each recompute in backward.

    A module already wrapped (by another handle) is not wrapped twice: the request
    joins its wrapper.
    """
    current = module.__dict__.get("forward")
    wrapper = current if isinstance(current, CheckpointedForward) else CheckpointedForward(module)
    request = Checkpointing(wrapper, enabled, position, warned)
    request.on_recompute = on_recompute
    wrapper.requests.append(request)
    return request
