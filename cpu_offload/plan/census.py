"""What one layer saves for backward, measured on the meta device, and its FLOPs.

:func:`measure_layer` builds a layer with ``torch.device("meta")`` as the default device,
runs its forward and backward on meta inputs (nothing is allocated), records every
tensor autograd saves through saved-tensor hooks, and classifies each with the
offloader's own rules (:func:`cpu_offload.selection.kept_because`, the view-to-base and
deduplication of :class:`cpu_offload.tensor_group.TensorGroupProcessor`), so that the bytes it
reports as offloaded are the bytes a real run's ``stats.bytes_offloaded`` counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ..layer_hooks import primary_tensor
from ..policy import checkpoint_hazards
from ..selection import DEFAULT_MIN_OFFLOAD_NUMEL, PARAMETER, kept_because
from ..tensor_group import TensorGroup, TensorGroupProcessor

__all__ = ["ATTENTIONS", "LayerProfile", "measure_layer"]

#: how ``scaled_dot_product_attention`` is measured: ``"flash"``, CUDA's flash kernel
#: (the efficient kernel when there is a mask): q, k, v, the output and a float32
#: log-sum-exp per row, O(s); ``"cpu"``, the CPU's flash kernel (what a CPU run saves);
#: ``"math"``, the math implementation (the s x s probabilities among what it saves).
ATTENTIONS = ("flash", "cpu", "math")
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
            (:func:`cpu_offload.policy.checkpoint_hazards`); the planner does not
            checkpoint a layer that has any.
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


class _Attention(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to the chosen kernel's meta function, so
    that autograd saves what that kernel's backward needs."""

    def __init__(self, attention: str, fused_dropout: bool) -> None:
        super().__init__()
        self.attention = attention
        self.fused_dropout = fused_dropout
        self.uncounted: list[tuple[torch.Size, torch.Size, torch.Size]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout and self.fused_dropout:
            given = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            p, training = given.get("p", 0.5), given.get("training", True)
            if training and 0 < p < 1 and not given.get("inplace", False):
                # GPUs and NPUs run the fused kernel, which saves a 1-byte mask.
                return torch.ops.aten.native_dropout(given["input"], p, True)[0]
            return func(*args, **kwargs)
        if func is not F.scaled_dot_product_attention or self.attention == "math":
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = dict(zip(names, args), **kwargs)
        q, k, v = given["query"], given["key"], given["value"]
        mask, dropout = given.get("attn_mask"), given.get("dropout_p", 0.0)
        causal, scale = given.get("is_causal", False), given.get("scale")
        aten = torch.ops.aten
        if self.attention == "cpu":
            self.uncounted.append((q.shape, k.shape, v.shape))  # no FLOP formula for it
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout, causal, attn_mask=mask, scale=scale
            )[0]
        if mask is None:
            return aten._scaled_dot_product_flash_attention(
                q, k, v, dropout, causal, False, scale=scale
            )[0]
        if k.shape[-3] != q.shape[-3]:  # the efficient kernel takes no grouped heads
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask.expand(q.shape[:-1] + k.shape[-2:-1]), True, dropout, causal, scale=scale
        )[0]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@contextlib.contextmanager
def _record(saved: list[torch.Tensor]) -> Iterator[None]:
    def pack(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
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
    mode = _Attention(attention, fused_dropout)
    with FlopCounterMode(display=False) as forward_counter, mode, _record(saved):
        output = layer(*inputs, **(kwargs or {}))
    primary = primary_tensor(output)
    if primary is None or primary.grad_fn is None:
        raise ValueError(
            "measure_layer: the layer's output has no tensor that requires grad; pass "
            "inputs that require grad or a layer with trainable parameters."
        )
    with FlopCounterMode(display=False) as backward_counter:
        primary.backward(torch.empty_like(primary))
    checkpointed = _classify(
        [t for t in inputs if isinstance(t, torch.Tensor)], layer, min_offload_numel
    )
    extra_forward = sum(sdpa_flop_count(q, k, v) for q, k, v in mode.uncounted)
    extra_backward = sum(sdpa_backward_flop_count(q, q, k, v) for q, k, v in mode.uncounted)
    return LayerProfile(
        **_classify(saved, layer, min_offload_numel),
        forward_flops=forward_counter.get_total_flops() + extra_forward,
        backward_flops=backward_counter.get_total_flops() + extra_backward,
        attention=attention,
        min_offload_numel=min_offload_numel,
        description=description,
        input_bytes=checkpointed["saved_bytes"],
        input_offloaded_bytes=checkpointed["offloaded_bytes"],
        input_tensors_offloaded=checkpointed["tensors_offloaded"],
        checkpoint_hazards=checkpoint_hazards(layer),
    )


def _classify(saved: list[torch.Tensor], layer: torch.nn.Module, min_numel: int) -> dict[str, Any]:
    """The byte and copy fields of a :class:`LayerProfile` for these saved tensors."""
    weights = {_storage_key(p) for p in layer.parameters()}
    buffers = {_storage_key(b) for b in layer.buffers()}
    device = torch.device("meta")
    activations: dict[int, int] = {}  # storage -> bytes
    kept: dict[int, str] = {}  # storage -> why it stays
    group = TensorGroup()
    rows = []
    for tensor in saved:
        key = _storage_key(tensor)
        if isinstance(tensor, torch.nn.Parameter) or key in weights:
            reason: str | None = PARAMETER
        elif key in buffers:
            reason = BUFFER
        else:
            reason = kept_because(tensor, device, min_numel)
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
