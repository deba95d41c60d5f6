"""Hooked layers inside a reentrant checkpoint: the checkpoint's saved inputs are the
layers' saved tensors.

NOTE [Layers inside a reentrant checkpoint]
    A reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``,
    Megatron-Core's ``tensor_parallel.checkpoint`` under ``recompute_granularity="full"``)
    is an autograd ``Function``: its ``forward`` runs the layers under no-grad, so the
    layers' contexts see nothing saved, and the ``Function`` saves its inputs after its
    ``forward`` returns, with the saved-tensor hooks that are active then.  Those inputs,
    one hidden state per recomputed chunk, are all the device holds of the chunk.

    When a hooked layer's forward starts inside such a ``forward`` (found by its frame: a
    ``forward(ctx, ...)`` whose ``ctx`` has a ``run_function``, both checkpoints' mark),
    :class:`ReentrantCheckpoints`

    1. registers on the checkpoint's node what ``sync_fn`` would have put on the layers'
       outputs: a pre-hook that runs the backward step of the chunk's last layer (which
       the inputs belong to) before the node unpacks them, and a hook that runs the other
       layers' steps after the node has recomputed them;
    2. as each offloaded layer of the chunk leaves its context, pushes that layer's pack
       hook again, so that it is the innermost when the ``Function`` saves its inputs (the
       next layer of the chunk takes it off before it enters the context): the inputs join
       the push cycle of the chunk's last layer, whose offload starts as the next layer's
       forward starts, as for any layer.  The pushed hook takes itself off once it has
       packed as many tensors as the checkpoint saves (counted at ``save_for_backward``:
       Megatron saves after running the layers, torch before).

    A checkpoint whose inputs need no gradient saves nothing, and nothing is pushed.
    Recomputation runs inside backward, where the contexts pass through.  The
    checkpoint's own RNG handling is untouched.  Where the inputs stay while an earlier
    layer of the chunk is offloaded (the chunk's last layer is kept), one warning per
    handle says why.  Under ``memory_budget=``, the measured step counts the inputs and
    the chunk's recompute, and the plan moves them with the chunk's last layer (NOTE [A
    budget around reentrant checkpoints] in reentrant_budget.py).
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from ..engine.backward_hook import BackwardHook
from ..hooks.autograd_hooks import (
    forward_inside_backward,
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    top_pack_hook,
)
from ..hooks.compiled_entry import untraced
from ..hooks.eager import eager
from ..hooks.handles import unpack_saved
from ..hooks.module_hooks import ModuleHook
from ..log import logger, warn
from .other_offloaders import other_offloader, other_offloader_warning
from .planned_synchronizer import PlannedOffloadSynchronizer, chunk_measure, ran_in_checkpoint
from .reentrant_budget import ChunkMeasure

if TYPE_CHECKING:
    from torch import nn

    from ..engine.forward_pass import ForwardPass
    from ..engine.layer_context import OffloadContext

__all__ = ["ReentrantCheckpoints", "enclosing_checkpoint", "watch_reentrant_checkpoints"]

#: how far up the stack a layer's forward looks for the checkpoint's ``forward``
_MAX_DEPTH = 64


def enclosing_checkpoint() -> Any:
    """The ``ctx`` of the reentrant checkpoint whose ``forward`` the caller runs in, or None
    (NOTE [Layers inside a reentrant checkpoint])."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "ctx":
            ctx = frame.f_locals.get("ctx")
            if hasattr(ctx, "run_function") and hasattr(ctx, "needs_input_grad"):
                return ctx
        frame = frame.f_back
    return None


class _SaveCount:
    """``ctx.save_for_backward`` counting what it saves (Megatron saves after the layers)."""

    __slots__ = ("save", "count")

    def __init__(self, save: Any) -> None:
        self.save = save
        self.count: int | None = None

    def __call__(self, *tensors: Any) -> None:
        self.count = sum(t is not None for t in tensors)
        self.save(*tensors)


class _InputsPack:
    """The pack hook pushed as a chunk's offloaded layer leaves: the layer's own, until
    the checkpoint's saved inputs are packed."""

    __slots__ = ("push", "counter", "packed", "owner", "measure", "tensors")

    def __init__(self, push: Any, counter: _SaveCount | int, owner: _Chunk) -> None:
        self.push = push
        self.counter = counter
        self.packed = 0
        self.owner = owner
        self.measure: ChunkMeasure | None = None  # a budget's measured step
        self.tensors: list[torch.Tensor] = []

    def expected(self) -> int | None:
        counter = self.counter
        return counter if isinstance(counter, int) else counter.count

    def __call__(self, tensor: Any) -> Any:
        handle = self.push(tensor)
        self.packed += 1
        if self.measure is not None and isinstance(tensor, torch.Tensor):
            self.tensors.append(tensor)
        expected = self.expected()
        if expected is None or self.packed >= expected:
            self.owner.take_off(self)
            self.owner.moved = True
            if self.measure is not None:
                tensors, self.tensors = self.tensors, []
                self.measure.inputs_saved(tensors)
        return handle


class _Chunk:
    """One thread's checkpoint in progress: its ``ctx`` (weakly: the graph owns it), the
    layers run in it, and the pack hook left pushed."""

    __slots__ = ("ctx", "counter", "layers", "last", "forward_pass", "pushed", "moved", "measure")

    def __init__(self, ctx: Any, counter: _SaveCount | int, forward_pass: ForwardPass) -> None:
        self.ctx = weakref.ref(ctx)
        self.counter = counter
        self.layers: list[int] = []  # all but the last, whose backward follows the node's
        self.last: list[int] = []  # the last, whose backward step precedes the node's
        self.forward_pass = forward_pass.weak
        self.pushed: _InputsPack | None = None
        self.moved = False  # the inputs were handed to a layer
        self.measure: ChunkMeasure | None = None  # a budget's measured step

    def take_off(self, pack: _InputsPack | None = None) -> None:
        """Pop the pushed pack hook if it is still the innermost one."""
        pushed = self.pushed
        if pushed is None or (pack is not None and pushed is not pack):
            return
        self.pushed = None
        if top_pack_hook() is pushed:
            pop_saved_tensor_hooks()


class _Current(threading.local):
    """Per thread: the checkpoint chunk that the last hooked layer ran in."""

    chunk: _Chunk | None = None
    open = False  # a layer of the chunk is between its forward's start and end


class ReentrantCheckpoints:
    """What :func:`~cpu_offload.offload_layers`' layers do inside a reentrant checkpoint
    (NOTE [Layers inside a reentrant checkpoint]): a forward pre-hook and post-hook on each
    layer, after the layer hooks."""

    def __init__(self, context: OffloadContext) -> None:
        self.context = context
        self.synchronizer = context.offload_synchronizer
        self._current = _Current()
        self.chunks = 0  #: checkpoints met whose inputs need gradients
        self._warned = False
        self._warned_peer = False
        self._checked: set[int] = set()  # layers whose first forward was looked at

    def entering(self, module: nn.Module, args: Any) -> None:
        """A layer's forward is about to enter the offload context: take off the pack hook
        the layer before it in a chunk left pushed (or a forward that raised left), and,
        until it is found once, look for another offloader on the layer (NOTE [Two
        offloaders on one layer]: the hooks around the layer are seen only here), at each
        layer's first forward with grad enabled."""
        chunk = self._current.chunk
        if chunk is not None:
            chunk.take_off()
        if not self._warned_peer and id(module) not in self._checked and torch.is_grad_enabled():
            self._checked.add(id(module))
            where = other_offloader(module)
            if where is not None:
                self._warned_peer = True
                warn(other_offloader_warning(where, module), UserWarning, stacklevel=2)

    def entered(self, module: nn.Module, args: Any) -> None:
        """A layer's forward has entered the offload context: note the checkpoint it runs
        in, if any."""
        current = self._current
        chunk, current.open = current.chunk, False
        if torch.is_grad_enabled():  # the common case first: no checkpoint's forward
            current.chunk = None
            ChunkMeasure.layer_enters()  # a measured chunk's recompute, if any
            return
        forward_pass = self.synchronizer.current_pass
        if not self.context.active or forward_pass is None or forward_inside_backward():
            current.chunk = None
            return
        ctx = enclosing_checkpoint()
        if ctx is None or not any(ctx.needs_input_grad):
            current.chunk = None  # evaluation, or a checkpoint that saves nothing
            return
        if chunk is None or chunk.ctx() is not ctx:
            chunk = current.chunk = self._new_chunk(ctx, forward_pass)
        if chunk.last:
            chunk.layers.append(chunk.last.pop())
        layer = forward_pass.layers_forwarded - 1
        chunk.last.append(layer)
        if isinstance(self.synchronizer, PlannedOffloadSynchronizer):
            self._measure(chunk, layer)
        current.open = True

    def left(self, module: nn.Module, args: Any, output: Any) -> None:
        """The layer's forward has left the offload context: leave its pack hook pushed for
        the checkpoint's inputs when the layer is offloaded."""
        current = self._current
        if not current.open:
            ChunkMeasure.layer_leaves()  # a measured chunk's recompute, if any
            return
        chunk = current.chunk
        if chunk is None:
            return
        current.open = False
        forward_pass = chunk.forward_pass()
        layer = chunk.last[-1]
        if forward_pass is None:
            return
        planned = isinstance(self.synchronizer, PlannedOffloadSynchronizer)
        if chunk.measure is not None or self.synchronizer.layer_is_offloaded(layer):
            pack = _InputsPack(forward_pass.state(layer).push_tensor, chunk.counter, chunk)
            pack.measure = chunk.measure
            push_saved_tensor_hooks(pack, unpack_saved)
            chunk.pushed = pack
        elif not planned and any(map(self.synchronizer.layer_is_offloaded, chunk.layers)):
            self._warn_once(
                f"cpu_offload: offloaded layers run inside a reentrant checkpoint "
                f"({type(chunk.ctx()).__name__}) whose last layer, {layer}, is kept: the "
                "checkpoint's saved inputs go with its last layer, so they stay on the "
                "device. Offload that layer too, or checkpoint the offloaded layers apart."
            )

    def _measure(self, chunk: _Chunk, layer: int) -> None:
        """A budget's layer in ``chunk``: it ran with grad, and where this pass is
        measured, the chunk's bytes are (NOTE [A budget around reentrant checkpoints])."""
        synchronizer = self.synchronizer
        assert isinstance(synchronizer, PlannedOffloadSynchronizer)
        measure = chunk.measure
        if measure is None and not chunk.layers:  # the chunk's first layer
            measure = chunk.measure = chunk_measure(synchronizer, layer)
            ctx = chunk.ctx()
            if measure is not None and ctx is not None:
                measure.warned = self._warn_once
                ctx.register_prehook(measure.recompute_starts)
                ctx.register_hook(measure.recompute_ends)
        ran_in_checkpoint(synchronizer, layer)
        if measure is not None:
            measure.order.append(layer)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warn(message, UserWarning, stacklevel=3)

    def remove(self) -> None:
        """Take off a pack hook still pushed in this thread (a checkpoint that raised)."""
        current = self._current
        if current.chunk is not None:
            current.chunk.take_off()
        current.chunk, current.open = None, False

    def _new_chunk(self, ctx: Any, forward_pass: ForwardPass) -> _Chunk:
        saved = getattr(ctx, "to_save", None)
        counter: _SaveCount | int
        if saved is not None:  # torch saves before running the layers
            counter = sum(t is not None for t in saved)
        else:
            counter = _SaveCount(ctx.save_for_backward)
            ctx.save_for_backward = counter
        chunk = _Chunk(ctx, counter, forward_pass)
        # The last layer's backward step reloads what the node unpacks first; the others'
        # steps follow the node (a step releases the layer whose backward ran before).
        ctx.register_prehook(BackwardHook(self.synchronizer, forward_pass, chunk.last))
        after = BackwardHook(self.synchronizer, forward_pass, chunk.layers)
        ctx.register_hook(lambda grad_inputs, grad_outputs: after(grad_outputs))
        self.chunks += 1
        logger.info(
            "offload_layers: layers run inside a reentrant checkpoint (%s); its saved inputs "
            "go with the chunk's last layer",
            type(ctx).__name__,
        )
        return chunk


def watch_reentrant_checkpoints(layers: list[nn.Module], context: OffloadContext) -> list[Any]:
    """Hook ``layers`` (after :func:`~cpu_offload.offload_layers`' own hooks) for the
    checkpoints they may run in; returns what to ``remove()``."""
    watcher = ReentrantCheckpoints(context)
    # ModuleHooks: a copy of the model gets pass-throughs (NOTE [Copies of hooked modules]);
    # run eagerly, never traced (NOTE [Hooks around compiled code]), nothing under dynamo
    first, pre, post = (
        ModuleHook(untraced(eager(hook)))
        for hook in (watcher.entering, watcher.entered, watcher.left)
    )
    removables: list[Any] = [watcher]
    for layer in layers:
        removables.append(layer.register_forward_pre_hook(first, prepend=True))
        removables.append(layer.register_forward_pre_hook(pre))
        removables.append(layer.register_forward_hook(post))
    return removables
