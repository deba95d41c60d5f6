"""The aten ops a ``QuantizedTensor`` handles, and the rule for every other op.

NOTE [The op table of quantized tensors]
A quantized tensor handles exactly the aten ops in :data:`QUANTIZED_OPS`, one entry
per op, registered with :func:`implements` next to the class they serve
(``tensor.py``).  Every other op raises ``NotImplementedError`` naming the op: an op that
would write into a quantized tensor says so (its components cannot hold an arbitrary
new value), any other says to call ``.dequantize()`` first.  Nothing dequantizes
implicitly: the tensors are saved activations that ``QuantizedLinear`` reads through
its components, and the offloader through ``prepare_for_saving``, so an implicit
fallback would only ever serve code that treats the saved value as a plain tensor,
at the price of a hidden full-precision copy (the memory the format exists to save)
and of views that are copies.  ``docs/quantized.md`` says the same to users.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NoReturn

from torch._ops import OpOverload
from torch.utils._pytree import tree_flatten

from .storage import QuantizedTensorStorage

__all__ = ["QUANTIZED_OPS", "Handler", "dispatch", "implements", "refuse"]

#: ``handler(func, args, kwargs)``, called in place of ``func`` on a quantized tensor
Handler = Callable[[OpOverload, tuple[Any, ...], dict[str, Any]], Any]

_TABLE: dict[OpOverload, Handler] = {}

#: the handled ops and their handlers (read-only; add one with :func:`implements`)
QUANTIZED_OPS: Mapping[OpOverload, Handler] = MappingProxyType(_TABLE)


def implements(*ops: OpOverload) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``ops``."""

    def register(handler: Handler) -> Handler:
        for op in ops:
            if op in _TABLE:
                raise ValueError(f"quantized: {op} already has a handler, {_TABLE[op]}.")
            _TABLE[op] = handler
        return handler

    return register


def dispatch(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func``'s handler; refuse an op that has none (see the NOTE above)."""
    handler = _TABLE.get(func)
    if handler is None:
        refuse(func, args, kwargs)
    return handler(func, args, kwargs)


def _name(func: OpOverload) -> str:
    schema = func._schema
    return f"{schema.name}.{schema.overload_name or 'default'}"


def refuse(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], why: str = ""
) -> NoReturn:
    """Raise ``NotImplementedError`` for ``func`` on the quantized tensor in its arguments.

    Args:
        func: the op.
        args: its positional arguments.
        kwargs: its keyword arguments.
        why: what the handler of an op in the table could not do; empty for an op
            outside the table.
    """
    _refuse_in_place(func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    quantized = next(value for value in flat if isinstance(value, QuantizedTensorStorage))
    if not why:
        handled = ", ".join(sorted(op.overloadpacket.__name__ for op in _TABLE))
        why = f"a quantized tensor handles only the ops in quantized.ops.QUANTIZED_OPS ({handled})."
    raise NotImplementedError(
        f"{type(quantized).__name__} does not support {_name(func)}: {why}"
        + " To compute with its value, call .dequantize() on it first (or .to(dtype)) and "
        "use the plain tensor, a full-precision copy. Offloaders move it through "
        "prepare_for_saving()/restore_from_saved(), as cpu_offload does."
    )


def _refuse_in_place(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise when ``func`` writes into a quantized tensor."""
    schema = func._schema
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, QuantizedTensorStorage):
            raise NotImplementedError(
                f"{type(value).__name__} does not support {_name(func)}: it would modify the "
                "quantized tensor in place, which its components cannot represent. "
                "Dequantize it first (q.dequantize()) and modify the plain tensor, or "
                "quantize the new value with the quantizer."
            )
