"""The pre-hook ``sync_fn`` puts on a layer output's node: backward reaching a layer
drives the offload schedule (releases, reloads, the end-of-backward callback).

It runs as written, never traced: compiled autograd traces Python hooks with dynamo,
and this module is on dynamo's skip list (NOTE [Hooks around compiled code] in
eager.py), so a traced call to the hook is a graph break that runs it eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..hooks.eager import eager
from .weight_pass import arm_second_backward

if TYPE_CHECKING:
    from .forward_pass import ForwardPass, GraphToken
    from .synchronizer import OffloadSynchronizer

__all__ = ["BackwardCall", "BackwardHook", "queue_end_of_backward"]


def queue_end_of_backward(callback: Callable[[], None]) -> bool:
    """Queue ``callback`` at the end of the running backward; False where that is impossible.

    Compiled autograd accepts engine callbacks only with ``fullgraph=True``; there the
    release at the end of backward is left to the graph freeing its saved tensors (see
    NOTE [Lifetime of a layer's data] in hooks/handles.py).
    """
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except (AssertionError, RuntimeError):
        return False
    return True


class BackwardHook:
    """Backward reaches the layers in ``layers`` (it holds the pass and its graph token:
    the graph owns them)."""

    __slots__ = ("synchronizer", "forward_pass", "layers", "token")

    def __init__(
        self, synchronizer: OffloadSynchronizer, forward_pass: ForwardPass, layers: list[int]
    ) -> None:
        self.synchronizer = synchronizer
        self.forward_pass = forward_pass
        self.layers = layers
        self.token: GraphToken = forward_pass.graph_token()

    @eager
    def __call__(self, grad_outputs: Any) -> None:
        forward_pass, synchronizer = self.forward_pass, self.synchronizer
        if not forward_pass.finish_queued:
            new = BackwardCall(self)
            forward_pass.finish_queued = queue_end_of_backward(new.finish)
            forward_pass.backward_call = weakref.ref(new) if forward_pass.finish_queued else None
        ref = forward_pass.backward_call
        call: BackwardCall | None = ref() if ref is not None else None
        if call is not None:
            node = torch._C._current_autograd_node()  # the node this hook sits on
            for layer in self.layers:
                call.nodes.setdefault(layer, node)
        for layer in reversed(self.layers):
            synchronizer.bwd_step(layer, forward_pass)

    def finish(self, reached: dict[int, Any]) -> None:
        """The backward ends; ``reached``: per layer, the node where it reached it."""
        self.synchronizer.finish_part_of_bwd(self.forward_pass)
        # a graph retained for a second backward (ZB-V's W): NOTE in weight_pass.py
        if getattr(self.synchronizer, "arms_second_backward", True):  # manual: False
            arm_second_backward(self.forward_pass, reached)


class BackwardCall:
    """One backward through a pass: the nodes where it reached the pass's layers.

    Only the running backward holds it (its end-of-backward callback is
    :meth:`finish`; the pass refers to it weakly), so the nodes go with the backward,
    whether it ends or raises, and never keep a dropped graph alive.
    """

    __slots__ = ("hook", "nodes", "__weakref__")

    def __init__(self, hook: BackwardHook) -> None:
        self.hook = hook
        self.nodes: dict[int, Any] = {}  # layer -> the node whose hook reached it first

    def finish(self) -> None:
        self.hook.finish(self.nodes)
