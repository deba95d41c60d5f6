"""The public entry point: ``get_cpu_offload_context`` and the context it returns."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch

from .autograd_hooks import (
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
from .backward_hook import BackwardHook
from .errors import CpuOffloadError
from .forward_pass import ForwardPass
from .handles import unpack_saved
from .per_thread import PerThread
from .selection import DEFAULT_MIN_OFFLOAD_NUMEL
from .synchronizer import (
    DefaultOffloadSynchronizer,
    ManualOffloadSynchronizer,
    OffloadSynchronizer,
)

__all__ = ["OffloadContext", "get_cpu_offload_context"]


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
        try:
            if new_pass:
                synchronizer.abort_forward()
            if skipped:
                for _ in range(skipped):
                    synchronizer.fwd_step()
                    synchronizer.fwd_end()
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
            warnings.warn(
                f"cpu_offload: more layers ran under the context than model_layers="
                f"{synchronizer.num_layers}: the output of layer {synchronizer.num_layers - 1} "
                "(the last) went into another `with ctx:` layer, which was counted as layer "
                "0 of a new forward pass. Pass model_layers equal to the number of "
                "`with ctx:` blocks in one forward pass. This warning is shown once.",
                UserWarning,
                stacklevel=3,
            )


def _check_flags(**flags: object) -> None:
    """The on/off parameters are bools (``enabled="yes"`` is a mistake, not True)."""
    for name, value in flags.items():
        if type(value).__name__ not in ("bool", "bool_"):  # bool, numpy.bool_
            raise TypeError(
                f"cpu_offload: {name} must be True or False, got {type(value).__name__} {value!r}."
            )


def _validate(
    num_layers: int | None,
    model_layers: int,
    offload_activations: bool,
    offload_weights: bool,
    manual_synchronization: bool,
    offload_stream: Any,
) -> None:
    if not offload_activations and not offload_weights:
        raise ValueError(
            "cpu_offload: offloading is enabled but nothing is chosen to offload: "
            "offload_activations=False and offload_weights=False. Pass "
            "offload_activations=True, or enabled=False."
        )
    if offload_weights:
        warnings.warn(
            "cpu_offload: offload_weights=True is deprecated and has no effect; only "
            "activations are offloaded"
            + ("." if offload_activations else ", and offload_activations=False: nothing is."),
            DeprecationWarning,
            stacklevel=3,
        )
    if offload_stream is not None and not manual_synchronization:
        raise ValueError(
            "cpu_offload: offload_stream can be given only with manual_synchronization=True; "
            "the default schedule creates its own stream."
        )
    if not manual_synchronization and isinstance(num_layers, int) and isinstance(model_layers, int):
        if model_layers > 1 and num_layers == model_layers - 1:
            warnings.warn(
                "cpu_offload: num_layers == model_layers - 1 offloads every layer but the last; "
                "copies cannot overlap with compute, so expect a slowdown. Offload fewer "
                "layers to hide the copies.",
                UserWarning,
                stacklevel=3,
            )


#: what ``get_cpu_offload_context`` returns as its context: a null context when disabled
ContextManager = OffloadContext | contextlib.nullcontext[None]
SyncFn = Callable[[Any], Any]
_Result = (
    tuple[ContextManager, SyncFn] | tuple[ContextManager, SyncFn, ManualOffloadSynchronizer | None]
)


@overload
def get_cpu_offload_context(
    enabled: bool = ...,
    num_layers: int | None = ...,
    model_layers: int = ...,
    offload_activations: bool = ...,
    offload_weights: bool = ...,
    double_buffering: bool = ...,
    manual_synchronization: Literal[False] = ...,
    retain_pinned_cpu_buffers: bool = ...,
    offload_stream: Any = ...,
    *,
    device: torch.device | str | None = ...,
    min_offload_numel: int = ...,
    min_offload_bytes: int = ...,
    max_host_bytes: int | None = ...,
    offloaded_layers: Sequence[int] | None = ...,
) -> tuple[ContextManager, SyncFn]: ...


@overload
def get_cpu_offload_context(
    enabled: bool = ...,
    num_layers: int | None = ...,
    model_layers: int = ...,
    offload_activations: bool = ...,
    offload_weights: bool = ...,
    double_buffering: bool = ...,
    *,
    manual_synchronization: Literal[True],
    retain_pinned_cpu_buffers: bool = ...,
    offload_stream: Any = ...,
    device: torch.device | str | None = ...,
    min_offload_numel: int = ...,
    min_offload_bytes: int = ...,
    max_host_bytes: int | None = ...,
) -> tuple[ContextManager, SyncFn, ManualOffloadSynchronizer | None]: ...


@overload
def get_cpu_offload_context(
    enabled: bool = ...,
    num_layers: int | None = ...,
    model_layers: int = ...,
    offload_activations: bool = ...,
    offload_weights: bool = ...,
    double_buffering: bool = ...,
    manual_synchronization: bool = ...,
    retain_pinned_cpu_buffers: bool = ...,
    offload_stream: Any = ...,
    *,
    device: torch.device | str | None = ...,
    min_offload_numel: int = ...,
    min_offload_bytes: int = ...,
    max_host_bytes: int | None = ...,
    offloaded_layers: Sequence[int] | None = ...,
) -> _Result: ...


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Any = None,
    *,
    device: torch.device | str | None = None,
    min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL,
    min_offload_bytes: int = 0,
    max_host_bytes: int | None = None,
    offloaded_layers: Sequence[int] | None = None,
) -> _Result:
    """Offload the activations of chosen layers to host memory.

    Drop-in compatible with TransformerEngine's and Megatron's call: the first nine
    parameters keep their positions.

    Args:
        enabled: when False, return a null context and an identity function.
        num_layers: layers to offload, ``k`` (default schedule): layers ``0..k-1``.
        model_layers: layers run under the context per forward pass, ``L``.
        offload_activations: offload activations; False (with ``offload_weights=True``,
            as TransformerEngine accepts) returns a null context and an identity.
        offload_weights: deprecated, no effect.
        double_buffering: accepted for compatibility, no effect.
        manual_synchronization: return a third value, a
            :class:`ManualOffloadSynchronizer`, and schedule nothing automatically.
        retain_pinned_cpu_buffers: reuse host buffers in later iterations (shapes
            must not change).
        offload_stream: stream for the copies (manual synchronization only).
        device: device whose activations are offloaded; default the best available.
        min_offload_numel: saved tensors with fewer elements stay on the device.
        min_offload_bytes: saved tensors of fewer bytes stay on the device (torchtune's
            ``min_offload_size``; a threshold in elements keeps twice the bytes in fp32
            that it keeps in bf16).
        max_host_bytes: the most host memory (pinned on accelerators) the offloader may
            hold, for ranks that share a host; a tensor that does not fit stays on the
            device, counted in ``stats.tensors_kept_by_host_cap``, with one warning.
        offloaded_layers: which layers to offload, in place of the first ``num_layers``
            (any layers but the last; the default schedule, see
            :class:`DefaultOffloadSynchronizer`).

    Returns:
        ``(context, sync_fn)``, or ``(context, sync_fn, controller)`` in manual mode.

    Raises:
        ValueError: for an inconsistent configuration.

    Example:
        >>> import torch
        >>> from cpu_offload import get_cpu_offload_context
        >>> layers = [torch.nn.Linear(256, 256) for _ in range(4)]
        >>> ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
        >>> x = torch.randn(32, 256, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = layer(x).relu()
        ...     x = sync_fn(x)
        >>> x.sum().backward()
    """
    _check_flags(
        enabled=enabled,
        offload_activations=offload_activations,
        offload_weights=offload_weights,
        double_buffering=double_buffering,
        manual_synchronization=manual_synchronization,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
    )
    del double_buffering  # accepted for compatibility
    if offloaded_layers is not None:
        if manual_synchronization:
            raise ValueError(
                "cpu_offload: offloaded_layers chooses layers for the default schedule; with "
                "manual_synchronization=True you call the transitions yourself. Pass one or "
                "the other."
            )
        num_layers = len(offloaded_layers) if isinstance(offloaded_layers, Sequence) else 0
    if enabled:
        _validate(
            num_layers,
            model_layers,
            offload_activations,
            offload_weights,
            manual_synchronization,
            offload_stream,
        )
    if not enabled or not offload_activations:
        # Disabled, or weights only (deprecated, as in TransformerEngine): nothing to do.
        identity: SyncFn = lambda x: x  # noqa: E731
        if manual_synchronization:
            return contextlib.nullcontext(), identity, None
        return contextlib.nullcontext(), identity
    if manual_synchronization:
        controller = ManualOffloadSynchronizer(
            model_layers,
            retain_pinned_cpu_buffers,
            offload_stream,
            device=device,
            min_offload_numel=min_offload_numel,
            min_offload_bytes=min_offload_bytes,
            max_host_bytes=max_host_bytes,
        )
        manual = OffloadContext(controller)
        return manual, manual.sync_fn, controller
    synchronizer = DefaultOffloadSynchronizer(
        model_layers,
        num_layers,  # type: ignore[arg-type]  # validated by the synchronizer
        retain_pinned_cpu_buffers,
        device=device,
        min_offload_numel=min_offload_numel,
        min_offload_bytes=min_offload_bytes,
        max_host_bytes=max_host_bytes,
        offloaded_layers=offloaded_layers,
    )
    context = OffloadContext(synchronizer)
    return context, context.sync_fn
