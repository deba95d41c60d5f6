"""What one operator costs a device: the FLOPs of the kernel it launches, by torch's own
formulas (``torch.utils.flop_counter``), and the bytes that kernel reads and writes.

The planner's census (``plan/census.py``) records these per kernel of a layer, and the
modeled runtime (``cpu_offload.testing.timed_runtime``) charges them to its clocks; a
:class:`~cpu_offload.device.profiles.DeviceProfile` turns them into seconds (its
``kernel_seconds``, a roofline).  An operator that only makes a view of a tensor, or only
allocates memory, launches no kernel.

Example:
    >>> import torch
    >>> from cpu_offload.device.kernel_costs import kernel_cost
    >>> a, b = torch.empty(64, 32, device="meta"), torch.empty(32, 16, device="meta")
    >>> out = torch.ops.aten.mm.default(a, b)
    >>> kernel_cost(torch.ops.aten.mm.default, (a, b), {}, out)  # 2*64*32*16 FLOPs
    (65536, 14336)
    >>> kernel_cost(torch.ops.aten.t.default, (a,), {}, a.t()) is None
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "ALIASES",
    "ALLOCATIONS",
    "ATTENTION_FLOP_FORMULAS",
    "FLOP_FORMULAS",
    "attention_backward_flops",
    "attention_flops",
    "kernel_cost",
    "memory_bytes",
    "storage_id",
    "tensors_in",
    "writes",
]

aten = torch.ops.aten

#: operators that allocate memory and launch nothing
ALLOCATIONS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
#: operators that make a tensor sharing its input's memory without the view flag
ALIASES = frozenset(
    {aten.detach.default, aten._unsafe_view.default, aten.alias.default, aten.lift_fresh.default}
)
_Tensor = torch.Tensor


def _heads_of(query: Any, other: Any) -> tuple[int, ...]:
    """``other``'s shape (batch, heads, sequence, width) with ``query``'s heads: grouped
    key and value heads counted as the query heads they serve."""
    shape = tuple(other)
    return shape[:-3] + (tuple(query)[-3],) + shape[-2:]


def attention_flops(query: Any, key: Any, value: Any) -> int:
    """FLOPs of an attention forward with these shapes, grouped-query attention included
    (torch's own formula rejects fewer key/value heads before 2.13)."""
    return int(sdpa_flop_count(tuple(query), _heads_of(query, key), _heads_of(query, value)))


def attention_backward_flops(grad_out: Any, query: Any, key: Any, value: Any) -> int:
    """FLOPs of an attention backward with these shapes, grouped-query attention included."""
    return int(
        sdpa_backward_flop_count(
            tuple(grad_out), tuple(query), _heads_of(query, key), _heads_of(query, value)
        )
    )


def _shape(value: Any) -> Any:
    return value.shape if isinstance(value, _Tensor) else value


def _forward_formula(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return attention_flops(_shape(query), _shape(key), _shape(value))


def _backward_formula(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return attention_backward_flops(_shape(grad_out), _shape(query), _shape(key), _shape(value))


_forward_formula._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode: as is
_backward_formula._get_raw = True  # type: ignore[attr-defined]
_ATTENTION = ("flash", "efficient", "cudnn")

#: the fused attentions' FLOP formulas, counting grouped key and value heads on every torch
#: version: ``FlopCounterMode(custom_mapping=ATTENTION_FLOP_FORMULAS)`` counts with them
ATTENTION_FLOP_FORMULAS: dict[Any, Any] = {
    **{getattr(aten, f"_scaled_dot_product_{a}_attention"): _forward_formula for a in _ATTENTION},
    **{
        getattr(aten, f"_scaled_dot_product_{a}_attention_backward"): _backward_formula
        for a in _ATTENTION
    },
}
#: torch's FLOP formulas by operator, with :data:`ATTENTION_FLOP_FORMULAS` in place of its own
FLOP_FORMULAS: dict[Any, Any] = {**flop_registry, **ATTENTION_FLOP_FORMULAS}


def storage_id(tensor: torch.Tensor) -> int | None:
    """An id of ``tensor``'s memory (its storage), or None for a tensor without a plain one."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def memory_bytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel touches to read or write ``tensor``: its elements, counted once
    along a broadcast (stride 0) dimension."""
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if stride != 0:
            count *= size
    return count * tensor.element_size()


def tensors_in(value: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or lists, tuples and dicts of them), appended
    to ``found``."""
    found = [] if found is None else found
    if isinstance(value, _Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found)
    return found


@functools.cache
def writes(func: Any) -> bool:
    """Whether ``func`` writes one of its arguments (an in-place or ``out=`` operator)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def kernel_cost(
    func: Any,
    args: Any,
    kwargs: Any,
    out: Any,
    inputs: list[torch.Tensor] | None = None,
    outputs: list[torch.Tensor] | None = None,
) -> tuple[int, int] | None:
    """``(flops, bytes)`` of the kernel that ``func(*args, **kwargs)`` launched (``out``
    is what it returned), or None when it launched none: a view, an alias, an
    allocation.  Bytes are what the kernel reads (its tensor arguments) and writes (its
    outputs); ``inputs`` and ``outputs``: those tensors, where the caller has them."""
    if getattr(func, "is_view", False) or func in ALIASES or func in ALLOCATIONS:
        return None
    if inputs is None:
        inputs = tensors_in(kwargs, tensors_in(args))
    if outputs is None:
        outputs = tensors_in(out)
    if outputs and not writes(func):
        given = {storage_id(t) for t in inputs}
        if all(storage_id(t) in given for t in outputs):
            return None  # outputs share their inputs' memory: metadata only
    nbytes = sum(memory_bytes(t) for t in inputs) + sum(memory_bytes(t) for t in outputs)
    formula = FLOP_FORMULAS.get(getattr(func, "_overloadpacket", None))
    flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
    return flops, nbytes
