"""The context each layer's forward runs in, and its sync function.

``with ctx:`` around a layer's forward starts that layer in its synchronizer (a new
forward pass after the last layer) and pushes the layer state's saved-tensor hooks;
``ctx.sync_fn(output)`` after it registers the backward pre-hook that drives the
schedule when backward reaches the layer (``backward_hook.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CpuOffloadError
from ..hooks.autograd_hooks import (
    ActiveToken,
    checkpoint_forward_active,
    enter_active,
    forward_inside_backward,
    leave_active,
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    saved_tensor_hooks_enabled,
    top_pack_hook,
)
from ..hooks.handles import unpack_saved
from ..hooks.per_thread import PerThread
from ..log import warn
from ..report.step_report import StepReport
from .backward_hook import BackwardHook
from .forward_pass import ForwardPass
from .synchronizer import OffloadSynchronizer

__all__ = ["OffloadContext"]


class _LayerInProgress:
    """What one thread's ``with ctx:`` block holds between entering and leaving."""

    __slots__ = (
        "inside",
        "inert",
        "hooks",
        "depth_token",
        "last_pass",
        "unattached_pass",
        "last_layer",
    )

    def __init__(self) -> None:
        self.inside = False
        self.inert = False  # the current (or last) layer forward passes through
        self.hooks: Callable[[Any], Any] | None = None  # the pack hook pushed for the layer
        self.depth_token: ActiveToken[int] | None = None
        # The pass and layer of the latest forward, for sync_fn. Weak: a pass belongs to
        # its graph. Strong from a layer's forward until its sync_fn hands the pass to the
        # layer's graph (a graph cut before the layer leaves no other owner).
        self.last_pass: weakref.ref[ForwardPass] | None = None
        self.unattached_pass: ForwardPass | None = None
        self.last_layer: int | None = None


#: what a layer entered while its stream is captured gets, without ``cuda_graph``
CAPTURE_REFUSED = (
    "cpu_offload: a layer entered the offload context while its stream is being captured "
    "into a CUDA graph (torch.cuda.graph, torch.cuda.make_graphed_callables), but the "
    "context was made without cuda_graph: its copies, events and host buffers would be "
    "decided per step in Python, which a graph's replay does not run. Pass "
    "cuda_graph=True (one graph per step) or cuda_graph='layer' (one graph per layer's "
    "forward and backward) to get_cpu_offload_context, offload_layers or "
    "cpu_offload.integrations.megatron.patch; or turn offload off around the capture "
    "(handle.enabled = False, enabled=False)."
)


class OffloadContext:
    """Context entered around each layer's forward; see :func:`get_cpu_offload_context`.

    One context may be used by several threads at once (each runs its own forward
    passes, as two threads may run forward and backward through one model without
    offload).

    A forward that runs inside a backward pass (activation checkpointing recomputing
    a layer) and a forward under ``torch.func`` transforms (which disable saved-tensor
    hooks) pass through the context untouched: they are not new forward passes.

    Attributes:
        offload_synchronizer: the synchronizer that schedules the copies.
    """

    def __init__(self, synchronizer: OffloadSynchronizer) -> None:
        self.offload_synchronizer = synchronizer
        self._layer = PerThread(_LayerInProgress)
        #: whether :attr:`inside_context` tells the truth (the Megatron integration turns
        #: it off where Megatron would assert that TransformerEngine is installed)
        self.report_inside_context = True
        self._warned_layer_count = False

    def __repr__(self) -> str:
        return f"OffloadContext({self.offload_synchronizer.describe()})"

    def report(self) -> StepReport:
        """What the last step did (``offload_synchronizer.report()``)."""
        return self.offload_synchronizer.report()

    @property
    def active(self) -> bool:
        """Whether a layer's forward is inside this context now, in this thread."""
        return self._layer.value.inside

    @property
    def inside_context(self) -> bool:
        """TransformerEngine's name for :attr:`active` (Megatron-Core reads it)."""
        return self._layer.value.inside and self.report_inside_context

    def __enter__(self) -> OffloadContext:
        return self.enter_layer()

    def enter_layer(self, skipped: int = 0, new_pass: bool = False) -> OffloadContext:
        """Enter the context for one layer's forward.

        Args:
            skipped: layers of the model that did not run before this one in this
                forward pass (a skipped block); they count as empty layers.
            new_pass: this layer starts a new forward pass (abandon the one in progress).
        """
        frame = self._layer.value
        if frame.inside:
            raise CpuOffloadError(
                "cpu_offload: the offload context was entered again before it was left. "
                "Use one `with ctx:` block per layer, and call sync_fn on the layer's "
                "output after the block."
            )
        frame.inert = forward_inside_backward() or not saved_tensor_hooks_enabled()
        if frame.inert:
            frame.inside = True
            return self
        synchronizer = self.offload_synchronizer
        if synchronizer.cuda_graph is None and synchronizer.backend.is_capturing():
            raise CpuOffloadError(CAPTURE_REFUSED)
        try:
            if new_pass:
                synchronizer.abort_forward(failed=False)
            if skipped:
                for _ in range(skipped):
                    synchronizer.skip_layer()
            layer, forward_pass = synchronizer.forward_step()
            forward_pass.layer_open = True
            frame.last_pass = forward_pass.weak
            frame.unattached_pass = forward_pass
            frame.last_layer = layer
            if synchronizer.layer_is_offloaded(layer) and not checkpoint_forward_active():
                pack = forward_pass.state(layer).push_tensor
                push_saved_tensor_hooks(pack, unpack_saved)
                frame.hooks = pack
        except BaseException:
            frame.unattached_pass = None
            synchronizer.abort_forward()  # __exit__ will not run: leave no pass in progress
            raise
        frame.depth_token = enter_active()
        frame.inside = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        frame = self._layer.value
        frame.inside = False
        if frame.inert:
            return
        if frame.depth_token is not None:
            leave_active(frame.depth_token)
            frame.depth_token = None
        if frame.hooks is not None:
            pop_saved_tensor_hooks()
            frame.hooks = None
        last_pass = frame.last_pass() if frame.last_pass is not None else None
        if last_pass is not None:
            last_pass.layer_open = False
        if exc_type is not None:
            # The next forward starts a fresh pass; the partial graph keeps what it
            # saved, so a backward through it computes what it would without offload,
            # and the pass goes with that graph (NOTE [Who owns a forward pass]).
            frame.unattached_pass = None
            self.offload_synchronizer.abort_forward()
        else:
            self.offload_synchronizer.fwd_end()

    def leave_interrupted(self) -> bool:
        """Leave a layer whose forward ended without leaving the context (a
        ``KeyboardInterrupt`` through forward hooks, which run on ``Exception`` only).

        Returns whether the context was left: not when other saved-tensor hooks were
        entered above this context's since, which only their owner can remove.
        """
        frame = self._layer.value
        if not frame.inside:
            return True
        hooks = frame.hooks
        if hooks is not None and top_pack_hook() != hooks:
            return False
        self.__exit__(KeyboardInterrupt, None, None)
        return True

    def sync_fn(self, tensor: Any) -> Any:
        """Mark the end of a layer: backward reaching ``tensor`` triggers the schedule.

        Returns ``tensor`` itself. Anything else passes through untouched: a tensor that
        does not require grad (evaluation, ``torch.no_grad``), ``None``, a tuple (call it
        on the tensor the next layer takes).
        """
        frame = self._layer.value
        if frame.inside:
            raise CpuOffloadError(
                "cpu_offload: the sync function was called inside the offload context; "
                "call it on the layer's output after the `with ctx:` block."
            )
        if frame.inert:
            return tensor
        last_pass = frame.last_pass
        forward_pass = last_pass() if last_pass is not None else None
        frame.unattached_pass = None
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if forward_pass is not None:
            forward_pass.note_output(tensor)
        grad_fn = tensor.grad_fn
        if grad_fn is None:
            return tensor
        if forward_pass is None or frame.last_layer is None:
            raise CpuOffloadError(
                "cpu_offload: the sync function was called without a layer forward before "
                "it. Call it once after each `with ctx:` block, on the layer's output."
            )
        layer = frame.last_layer
        if layer == 0 and forward_pass.follows is not None:
            self._check_layer_count(forward_pass)
        hooked = forward_pass.hooked_output() if forward_pass.hooked_output else None
        if hooked is tensor:
            # The layer returned its input (an identity or skipped block): its backward
            # is empty and comes first at the node the layer before it hooked.
            forward_pass.hooked_layers.append(layer)
            return tensor
        layers = [layer]
        grad_fn.register_prehook(BackwardHook(self.offload_synchronizer, forward_pass, layers))
        forward_pass.hooked_output = weakref.ref(tensor)
        forward_pass.hooked_layers = layers
        return tensor

    def _check_layer_count(self, forward_pass: ForwardPass) -> None:
        """Warn when the last layer's output went into another layer under the context:
        more layers run per forward pass than ``model_layers`` says."""
        previous = forward_pass.follows() if forward_pass.follows is not None else None
        forward_pass.follows = None
        output = previous._last_output if previous is not None else None
        if output is None or output.expired() or self._warned_layer_count:
            return
        first = forward_pass.made_state(0)
        if first is not None and first.holds_storage(output.cdata):
            self._warned_layer_count = True
            synchronizer = self.offload_synchronizer
            warn(
                f"cpu_offload: more layers ran under the context than model_layers="
                f"{synchronizer.model_layers}: the output of layer "
                f"{synchronizer.model_layers - 1} "
                "(the last) went into another `with ctx:` layer, which was counted as layer "
                "0 of a new forward pass. Pass model_layers equal to the number of "
                "`with ctx:` blocks in one forward pass. This warning is shown once.",
                UserWarning,
                stacklevel=3,
            )
