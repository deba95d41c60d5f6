"""The public entry point: ``get_cpu_offload_context``, TransformerEngine's call.

It checks the configuration, builds the synchronizer (``synchronizer.py``) and returns
the context each layer runs in (``layer_context.py``) with its sync function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch

from .engine.layer_context import OffloadContext
from .engine.manual_synchronizer import ManualOffloadSynchronizer
from .engine.reload_slices import check_on_demand, check_slice_bytes
from .engine.synchronizer import DefaultOffloadSynchronizer
from .graphs.graph_options import check_cuda_graph
from .graphs.graph_synchronizer import GraphSynchronizer
from .hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL
from .log import logger, warn

__all__ = ["get_cpu_offload_context"]


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
        warn(
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
            warn(
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
    max_host_bytes: int | str | None = ...,
    offloaded_layers: Sequence[int] | None = ...,
    keep_passes: int | None = ...,
    reload_slice_bytes: int | None = ...,
    reload_on_demand_layers: Sequence[int] = ...,
    cuda_graph: bool | str = ...,
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
    max_host_bytes: int | str | None = ...,
    reload_slice_bytes: int | None = ...,
    reload_on_demand_layers: Sequence[int] = ...,
    cuda_graph: bool | str = ...,
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
    max_host_bytes: int | str | None = ...,
    offloaded_layers: Sequence[int] | None = ...,
    keep_passes: int | None = ...,
    reload_slice_bytes: int | None = ...,
    reload_on_demand_layers: Sequence[int] = ...,
    cuda_graph: bool | str = ...,
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
    max_host_bytes: int | str | None = None,
    offloaded_layers: Sequence[int] | None = None,
    keep_passes: int | None = None,
    reload_slice_bytes: int | None = None,
    reload_on_demand_layers: Sequence[int] = (),
    cuda_graph: bool | str = False,
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
            hold, for ranks that share a host: bytes, a string such as ``"64GiB"``, or
            ``"auto"`` (80% of the node's available memory, or of its cgroup's where
            lower, divided by ``LOCAL_WORLD_SIZE``; ``host_cap.py``).  A tensor that does
            not fit stays on the device, counted in ``stats.tensors_kept_by_host_cap``,
            with one warning; ``report().to_dict()["host_cap_bytes"]`` is the cap.
        offloaded_layers: which layers to offload, in place of the first ``num_layers``
            (any layers but the last; the default schedule, see
            :class:`DefaultOffloadSynchronizer`).
        keep_passes: for pipeline stages, where several forward passes are in flight:
            the ``N`` passes whose backwards come next keep the schedule above, and
            every other pass is moved whole to the host (all its layers, the last
            included) and prefetched back when the backward of an older pass starts.
            None (default): every pass keeps the schedule.  An int >= 1; not with
            manual synchronization.
        reload_slice_bytes: reload each offloaded layer in slices of about this many
            bytes, in backward order, each slice's copy issued as the slice before it
            starts being consumed, for a lower peak in backward than a whole layer
            brought back at once (NOTE [Reloading a layer in slices] in
            engine/reload_slices.py).  None (default): whole layers.  An int >= 1.
        reload_on_demand_layers: with ``reload_slice_bytes``, the layers whose slices
            are copied back only as backward first takes from each, no slice prefetched:
            the layers where the step peaks, so that a prefetched slice does not land on
            the peak (NOTE [Slices at the peak]; ``choose_policy``'s plan names them).
            Default: none.
        cuda_graph: run inside CUDA graphs: ``True`` (or ``"step"``) where one graph
            captures a whole step (forward and backward; copies overlap compute as in
            eager), ``"layer"`` where each layer's forward and backward is a graph of its
            own (``make_graphed_callables`` per layer; a layer's copies finish in its own
            graphs).  Host buffers are kept per layer, fixed; outside a capture the context
            runs as eager.  Not with manual synchronization, ``keep_passes`` or
            ``reload_slice_bytes`` (NOTE [Graph shapes] in graphs/graph_options.py).
            Default False: a layer entered under capture raises ``CpuOffloadError``.

    Returns:
        ``(context, sync_fn)``, or ``(context, sync_fn, controller)`` in manual mode.

    Raises:
        ValueError: for an inconsistent configuration.
        TypeError: ``cuda_graph`` is not a bool, ``"step"`` or ``"layer"``.

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
    api = "get_cpu_offload_context"
    per_step = {"manual_synchronization": manual_synchronization, "keep_passes": keep_passes}
    scope = check_cuda_graph(cuda_graph, api, reload_slice_bytes=reload_slice_bytes, **per_step)
    slice_bytes = check_slice_bytes(reload_slice_bytes, api)
    on_demand = check_on_demand(reload_on_demand_layers, slice_bytes, model_layers, api)
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
        if keep_passes is not None:
            raise ValueError(
                f"cpu_offload: keep_passes={keep_passes!r} chooses which passes the default "
                "schedule moves whole; with manual_synchronization=True you call the "
                "transitions yourself. Pass one or the other."
            )
        controller = ManualOffloadSynchronizer(
            model_layers,
            retain_pinned_cpu_buffers,
            offload_stream,
            device=device,
            min_offload_numel=min_offload_numel,
            min_offload_bytes=min_offload_bytes,
            max_host_bytes=max_host_bytes,
        )
        controller.reload_slice_bytes = slice_bytes
        controller.reload_on_demand_layers = on_demand
        manual = OffloadContext(controller)
        logger.info("get_cpu_offload_context: %r", manual)
        return manual, manual.sync_fn, controller
    synchronizer = (DefaultOffloadSynchronizer if scope is None else GraphSynchronizer)(
        model_layers,
        num_layers,  # type: ignore[arg-type]  # validated by the synchronizer
        retain_pinned_cpu_buffers,
        device=device,
        min_offload_numel=min_offload_numel,
        min_offload_bytes=min_offload_bytes,
        max_host_bytes=max_host_bytes,
        offloaded_layers=offloaded_layers,
        keep_passes=keep_passes,
        **({} if scope is None else {"scope": scope}),
    )
    synchronizer.reload_slice_bytes = slice_bytes
    synchronizer.reload_on_demand_layers = on_demand
    context = OffloadContext(synchronizer)
    logger.info("get_cpu_offload_context: %r", context)
    return context, context.sync_fn
