"""What one layer saves for backward, measured on the meta device, and its FLOPs.

:func:`measure_layer` builds a layer with ``torch.device("meta")`` as the default device,
runs its forward and backward on meta inputs (nothing is allocated), records every
tensor autograd saves through saved-tensor hooks, and classifies each with the
offloader's own rules (:func:`cpu_offload.hooks.selection.kept_because`, the view-to-base and
deduplication of :class:`cpu_offload.hooks.tensor_group.TensorGroupProcessor`), so that the bytes it
reports as offloaded are the bytes a real run's ``stats.bytes_offloaded`` counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..device.kernel_costs import (
    ATTENTION_FLOP_FORMULAS,
    attention_backward_flops,
    attention_flops,
    kernel_cost,
)
from ..device.kernels import ATTENTIONS, DeviceKernels
from ..hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL, KEPT_BY_MODULES, PARAMETER, kept_because
from ..hooks.tensor_group import TensorGroup, TensorGroupProcessor
from ..policy.layer_discovery import primary_tensor
from ..policy.module_choices import resolve_modules
from ..policy.policy import checkpoint_hazards
from .module_census import Where, attention_site, offloaded_unpacks, saved_by

__all__ = ["ATTENTIONS", "LayerProfile", "measure_layer"]

BUFFER = "buffer"


@dataclass
class LayerProfile:
    """One layer's saved activations and FLOPs (per forward and backward of one input).

    Attributes:
        saved_bytes: activation bytes the layer saves: unique storages, without
            parameters and buffers.
        offloaded_bytes: what the offloader copies to the host for this layer
            (``stats.bytes_offloaded`` of one layer and step).
        kept_bytes: activation bytes still on the device once the layer is offloaded
            (storages of the saved tensors that stay).
        kept_by_reason: ``kept_bytes`` split by why the tensors stay ("small", "not
            dense", "marked", ...).
        tensors_offloaded: copies per layer and step (``stats.tensors_offloaded``).
        forward_flops, backward_flops: from ``torch.utils.flop_counter``.
        attention: which attention was measured (see :data:`ATTENTIONS`).
        min_offload_numel: the threshold the classification used.
        description: what was measured (shapes, dtype).
        input_bytes: what the layer keeps saved when it is checkpointed: the storages of
            its positional tensor inputs (what non-reentrant checkpointing saves).
        input_offloaded_bytes, input_tensors_offloaded: what the offloader copies of
            those when the layer is checkpointed and offloaded.
        checkpoint_hazards: why recomputing the layer would change training
            (:func:`cpu_offload.policy.policy.checkpoint_hazards`); the planner does not
            checkpoint a layer that has any.
        following: what each layer after the first of a stack saves, when it differs
            from this profile (None: the same).  Their input is the previous layer's
            output, not the example input: a strided view of a larger tensor, say, which
            moves through its base.  NOTE [The layers after the first]
        unpredictable: empty, or which layers the plan could not predict, and why.
        forward_kernels, backward_kernels: ``(flops, bytes)`` of each kernel the
            forward and the backward launch (``kernel_costs.kernel_cost``): a device
            profile times them as a roofline (``DeviceProfile.compute_seconds``).
        recompute_kernels: the kernels a checkpointed layer runs again in backward: its
            forward's up to its last saved tensor (non-reentrant checkpointing stops
            there: ``torch.utils.checkpoint``'s early stop).
        saved_by_module, saved_by_kind: ``saved_bytes`` split by the innermost submodule
            that saved each storage (``""``: the layer's own code) and by the kind of
            operation that made it (``"matmul"``, ``"attention"``, ``"norm"``,
            ``"elementwise"``, ``"input"``).
        offloaded_unpacks: per offloaded storage, in pack order, ``(bytes, backward
            kernels run before its first unpack, rank of that unpack)``: when backward
            consumes each slice of a layer reloaded in slices (NOTE [Timing the slices
            of a reload] in schedule_model.py).
        forward_sites: per forward kernel, ``(submodule path, kind)`` of the operation
            that launched it: FLOPs and recompute cost per part
            (:func:`~cpu_offload.plan.module_census.costs_by`).
    """

    saved_bytes: int
    offloaded_bytes: int
    kept_bytes: int
    kept_by_reason: dict[str, int]
    tensors_offloaded: int
    forward_flops: int
    backward_flops: int
    attention: str
    min_offload_numel: int
    description: str = ""
    input_bytes: int = 0
    input_offloaded_bytes: int = 0
    input_tensors_offloaded: int = 0
    checkpoint_hazards: list[str] = field(default_factory=list)
    saved: list[tuple[tuple[int, ...], str, str]] = field(default_factory=list, repr=False)
    following: LayerProfile | None = None
    unpredictable: str = ""
    forward_kernels: list[tuple[int, int]] = field(default_factory=list, repr=False)
    backward_kernels: list[tuple[int, int]] = field(default_factory=list, repr=False)
    recompute_kernels: list[tuple[int, int]] = field(default_factory=list, repr=False)
    saved_by_module: dict[str, int] = field(default_factory=dict, repr=False)
    saved_by_kind: dict[str, int] = field(default_factory=dict, repr=False)
    forward_sites: list[tuple[str, str]] = field(default_factory=list, repr=False)
    offloaded_unpacks: list[tuple[int, int, int]] = field(default_factory=list, repr=False)


class _Kernels(TorchDispatchMode):
    """Records ``(flops, bytes)`` of every kernel launched inside it; with ``where``,
    the submodule and kind of operation of each (``sites``)."""

    def __init__(self, where: Where | None = None) -> None:
        super().__init__()
        self.kernels: list[tuple[int, int]] = []
        self.sites: list[tuple[str, str]] = []
        self.where = where
        self.at_last_save = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = kernel_cost(func, args, kwargs, out)
        if cost is not None:
            self.kernels.append(cost)
            if self.where is not None:
                self.sites.append(self.where.site(func))
        return out


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@contextlib.contextmanager
def _record(
    saved: list[torch.Tensor],
    kernels: _Kernels | None = None,
    where: Where | None = None,
    unpacked: tuple[_Kernels, dict[int, int]] | None = None,
) -> Iterator[None]:
    """Record what autograd saves; with ``kernels``, how many kernels had run at the
    last save (``LayerProfile.recompute_kernels``); with ``where``, the submodules each
    was saved in; with ``unpacked`` (the backward's kernels and a dict), how many of
    the backward's kernels had run at each saved tensor's first unpack, by its index."""

    def pack(tensor: Any) -> Any:
        index = -1
        if isinstance(tensor, torch.Tensor):
            index = len(saved)
            saved.append(tensor)
            if where is not None:
                where.note()
        if kernels is not None:
            kernels.at_last_save = len(kernels.kernels)
        return index, tensor

    def unpack(packed: tuple[int, Any]) -> Any:
        index, tensor = packed
        if unpacked is not None and index >= 0:
            unpacked[1].setdefault(index, len(unpacked[0].kernels))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def measure_layer(
    make_layer: Callable[[], torch.nn.Module] | torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL,
    attention: str = "flash",
    fused_dropout: bool = True,
    description: str = "",
    modules: object = None,
) -> LayerProfile:
    """Measure what one layer saves and how many FLOPs it runs, without memory.

    Args:
        make_layer: called with ``torch.device("meta")`` as the default device; or a
            module already on the meta device.
        example_inputs: the layer's positional inputs, meta tensors (a floating input
            that is a leaf is made to require grad, as a hidden state mid-stack does).
        kwargs: keyword arguments of the layer's forward.
        min_offload_numel: the offloader's threshold (``get_cpu_offload_context``'s).
        attention: which kernel ``scaled_dot_product_attention`` is measured as, one of
            :data:`ATTENTIONS` (on the meta device it would run the math implementation).
        fused_dropout: dropout as GPUs and NPUs run it (a 1-byte mask saved); False for
            the CPU's, which saves the scaled mask in the input's dtype.
        description: carried into the profile.
        modules: ``offload_layers``'s ``modules=``: what it keeps is counted as kept
            (reason ``"modules= keep"``), as an offloaded layer with those choices keeps it.

    Returns:
        A :class:`LayerProfile`.

    Example:
        >>> import torch
        >>> from cpu_offload.plan import measure_layer
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU())
        >>> x = torch.empty(8, 1024, device="meta")
        >>> profile = measure_layer(make, x, min_offload_numel=0)
        >>> profile.saved_bytes, profile.offloaded_bytes  # the input and the GELU input
        (163840, 163840)
    """
    if attention not in ATTENTIONS:
        raise ValueError(
            f"measure_layer: attention must be one of {ATTENTIONS}, got {attention!r}."
        )
    if isinstance(make_layer, torch.nn.Module):
        layer = make_layer
    else:
        with torch.device("meta"):
            layer = make_layer()
    inputs = [example_inputs] if isinstance(example_inputs, torch.Tensor) else list(example_inputs)
    for index, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                raise ValueError(
                    f"measure_layer: example input {index} is on {value.device}; pass meta "
                    "tensors (torch.empty(shape, device='meta')) so that nothing is allocated."
                )
            if value.is_floating_point() and value.is_leaf and not value.requires_grad:
                inputs[index] = value.detach().requires_grad_()
    saved: list[torch.Tensor] = []
    mode = DeviceKernels(attention, fused_dropout)
    where = Where(layer)
    forward_kernels, backward_kernels = _Kernels(where), _Kernels()
    first_unpacks: dict[int, int] = {}
    recording = _record(saved, forward_kernels, where, (backward_kernels, first_unpacks))
    forward_counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOP_FORMULAS)
    with forward_counter, mode, recording, forward_kernels:
        with where.recording():
            output = layer(*inputs, **(kwargs or {}))
    choices, rest = resolve_modules([layer], modules, "measure_layer") if modules else ([{}], "")
    keep = where.kept(choices[0], rest) if modules else None
    primary = primary_tensor(output)
    if primary is None or primary.grad_fn is None:
        raise ValueError(
            "measure_layer: the layer's output has no tensor that requires grad; pass "
            "inputs that require grad or a layer with trainable parameters."
        )
    backward_counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOP_FORMULAS)
    with backward_counter, backward_kernels:
        primary.backward(torch.empty_like(primary))
    extra_forward = sum(attention_flops(q, k, v) for q, k, v in mode.uncounted)
    extra_backward = sum(attention_backward_flops(q, q, k, v) for q, k, v in mode.uncounted)
    if mode.uncounted:  # attention kernels without a FLOP formula: their FLOPs on top
        forward_kernels.kernels.append((extra_forward, 0))
        forward_kernels.sites.append(attention_site(forward_kernels.sites))
        backward_kernels.kernels.append((extra_backward, 0))
    profile = LayerProfile(
        **_census(saved, inputs, layer, min_offload_numel, keep),
        forward_flops=forward_counter.get_total_flops() + extra_forward,
        backward_flops=backward_counter.get_total_flops() + extra_backward,
        attention=attention,
        min_offload_numel=min_offload_numel,
        description=description,
        checkpoint_hazards=checkpoint_hazards(layer),
        forward_kernels=forward_kernels.kernels,
        backward_kernels=backward_kernels.kernels,
        recompute_kernels=forward_kernels.kernels[: forward_kernels.at_last_save],
        forward_sites=forward_kernels.sites,
    )
    profile.offloaded_unpacks = offloaded_unpacks(saved, profile.saved, first_unpacks)
    activations = _activation_storages(saved, layer)
    profile.saved_by_module, profile.saved_by_kind = saved_by(saved, where, activations)

    def run(chained: list[Any]) -> tuple[dict[str, Any], Any]:
        saved_again: list[torch.Tensor] = []
        again = Where(layer)
        with DeviceKernels(attention, fused_dropout), _record(saved_again, where=again):
            with again.recording():
                result = layer(*chained, **(kwargs or {}))
        kept = again.kept(choices[0], rest) if modules else None
        return _census(saved_again, chained, layer, min_offload_numel, kept), result

    profile.following, profile.unpredictable = _following_layers(profile, inputs, output, run)
    return profile


# NOTE [The layers after the first]
# A stack's first layer receives the example input (the embeddings' output, a tensor of
# its own); every later layer receives the output of the layer before it.  Where that
# output is laid out otherwise (a strided view of a larger tensor, say), what a layer
# saves of its input moves otherwise: a view that cannot be copied by itself moves
# through its base (tensor_group.offloads_through_base), as a checkpointed layer's input
# or as what its first operation saves.  So measure_layer runs the layer again on its own
# output, the input of layers 1 to L-1, and keeps that census as ``following`` where it
# differs; the schedule model counts layer 0 with the first census and the others with
# ``following``.  If that run's output is laid out otherwise again, layer 2 is measured
# as well, and where it differs from layer 1 the plan says it cannot predict layers 2 to
# L-1 (``unpredictable``) instead of counting them silently as layer 1.


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What of a layer's input decides how the offloader moves what is saved of it."""
    base = tensor._base
    return (
        tensor.shape,
        tensor.dtype,
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
        None if base is None else (base.shape, base.stride(), base.storage_offset()),
    )


def _bytes_of(profile: LayerProfile) -> tuple[int, ...]:
    return (
        profile.saved_bytes,
        profile.offloaded_bytes,
        profile.kept_bytes,
        profile.tensors_offloaded,
        profile.input_bytes,
        profile.input_offloaded_bytes,
        profile.input_tensors_offloaded,
    )


def _following_layers(
    first: LayerProfile,
    inputs: list[Any],
    output: Any,
    run: Callable[[list[Any]], tuple[dict[str, Any], Any]],
) -> tuple[LayerProfile | None, str]:
    """``following`` and ``unpredictable`` of a :class:`LayerProfile` (NOTE [The layers
    after the first]): the census of the layer on its own output, where it differs."""
    profiles = [first]
    given = inputs[0] if inputs else None
    for _ in range(2):  # layers 1 and 2
        passed_on = primary_tensor(output)
        if (
            not isinstance(given, torch.Tensor)
            or passed_on is None
            or (passed_on.shape, passed_on.dtype) != (given.shape, given.dtype)
        ):
            break  # not a stack of this layer: its inputs are the example's
        if _layout(passed_on) == _layout(given):
            break  # the same input as the layer before: the same census
        census, output = run([passed_on, *inputs[1:]])
        profiles.append(dataclasses.replace(first, **census))
        given = passed_on
    if len(profiles) == 1 or _bytes_of(profiles[1]) == _bytes_of(first):
        return None, ""
    following = profiles[1]
    if (
        len(profiles) == 3
        and isinstance(given, torch.Tensor)
        and _bytes_of(profiles[2]) != _bytes_of(following)
    ):
        return following, (
            "layers 2 to L-1: the layer's output is laid out otherwise from layer to layer "
            f"(layer 2 receives shape {tuple(given.shape)}, stride {given.stride()}), so what "
            f"they save differs from layer 1 ({profiles[2].offloaded_bytes} B offloaded "
            f"against {following.offloaded_bytes} B); the plan counts them as layer 1"
        )
    return following, ""


def _census(
    saved: list[torch.Tensor],
    inputs: list[Any],
    layer: torch.nn.Module,
    min_numel: int,
    keep: list[bool] | None = None,
) -> dict[str, Any]:
    """The census fields of a :class:`LayerProfile`: what the layer saves, and what it
    keeps saved when checkpointed (its positional tensor inputs)."""
    checkpointed = _classify([t for t in inputs if isinstance(t, torch.Tensor)], layer, min_numel)
    return _classify(saved, layer, min_numel, keep) | {
        "input_bytes": checkpointed["saved_bytes"],
        "input_offloaded_bytes": checkpointed["offloaded_bytes"],
        "input_tensors_offloaded": checkpointed["tensors_offloaded"],
    }


def _activation_storages(saved: list[torch.Tensor], layer: torch.nn.Module) -> set[int]:
    """The storages among ``saved`` that are activations (no parameter, buffer or cast
    of a weight)."""
    excluded = {_storage_key(t) for t in (*layer.parameters(), *layer.buffers())}
    device = torch.device("meta")
    return {
        _storage_key(t)
        for t in saved
        if _storage_key(t) not in excluded
        and not isinstance(t, torch.nn.Parameter)
        and kept_because(t, device, 0) != PARAMETER
    }


def _classify(
    saved: list[torch.Tensor],
    layer: torch.nn.Module,
    min_numel: int,
    keep: list[bool] | None = None,
) -> dict[str, Any]:
    """The byte and copy fields of a :class:`LayerProfile` for these saved tensors;
    ``keep``: per tensor, whether ``modules=`` keeps it."""
    weights = {_storage_key(p) for p in layer.parameters()}
    buffers = {_storage_key(b) for b in layer.buffers()}
    device = torch.device("meta")
    activations: dict[int, int] = {}  # storage -> bytes
    kept: dict[int, str] = {}  # storage -> why it stays
    group = TensorGroup()
    rows = []
    for index, tensor in enumerate(saved):
        key = _storage_key(tensor)
        if isinstance(tensor, torch.nn.Parameter) or key in weights:
            reason: str | None = PARAMETER
        elif key in buffers:
            reason = BUFFER
        else:
            reason = kept_because(tensor, device, min_numel)
            if reason is None and keep is not None and keep[index]:
                reason = KEPT_BY_MODULES
            if reason != PARAMETER:  # a cast of a weight (autocast) counts as a weight
                activations[key] = tensor.untyped_storage().nbytes()
        rows.append((tuple(tensor.shape), str(tensor.dtype), reason or "offloaded"))
        if reason is None:
            group.append(tensor, None)
        elif key in activations:
            kept.setdefault(key, reason)
    unique = TensorGroupProcessor.process_before_offload(group)
    by_reason: dict[str, int] = {}
    for key, reason in kept.items():
        by_reason[reason] = by_reason.get(reason, 0) + activations[key]
    return {
        "saved_bytes": sum(activations.values()),
        "offloaded_bytes": sum(t.numel() * t.element_size() for t in unique.tensor_list),
        "kept_bytes": sum(by_reason.values()),
        "kept_by_reason": by_reason,
        "tensors_offloaded": len(unique.tensor_list),
        "saved": rows,
    }
