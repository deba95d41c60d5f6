"""``QuantizedTensor``: a quantized value with tensor semantics, and its handled ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

from .ops import dispatch, implements, refuse
from .storage import QuantizedTensorStorage

__all__ = ["QuantizedTensor"]

aten = torch.ops.aten


# dequantize(dtype=None) widens torch.Tensor.dequantize(); the dispatch signature is torch's.
class QuantizedTensor(torch.Tensor, QuantizedTensorStorage):  # type: ignore[misc]
    """A wrapper tensor subclass holding quantized components.

    It has the shape and the nominal (high-precision) dtype of the value it stands
    for, and handles the aten ops of an explicit table, ``quantized.ops.QUANTIZED_OPS``
    (the handlers are below the class): ``detach`` and ``alias`` share the components;
    ``.to(device)``/``.cpu()`` and ``pin_memory()`` move or pin the components and stay
    quantized; ``is_pinned()`` asks the components; a dtype conversion (``.to(dtype)``,
    ``.float()``) returns the dequantized value in that dtype.  Metadata (shape, dtype,
    device, strides) needs no op.

    Every other op raises ``NotImplementedError`` naming the op (see NOTE [The op table
    of quantized tensors] in ``ops.py``): one that would modify the tensor in place
    (``add_``, ``zero_``, ``copy_`` into it, ``out=``) because the components cannot
    hold an arbitrary new value, any other (``q + 1``, ``q @ w``, ``q.view(-1)``,
    ``x.copy_(q)``) because it would silently compute on a full-precision copy.
    Call :meth:`dequantize` first to do that on purpose.  Why refuse rather than
    dequantize (as TransformerEngine does): these tensors are saved activations;
    ``QuantizedLinear`` reads their components and the offloader moves them through
    ``prepare_for_saving``, so no path of ours needs the fallback, and code that
    reaches it would pay a hidden full-precision copy per op (the memory the format
    exists to save) and get views that are copies.

    Subclasses declare their components (annotated ``Component``) and typed metadata
    attributes, and implement :meth:`dequantize`; the constructor takes ``shape``,
    ``dtype`` and every declared field as keyword arguments (an absent component is
    ``None``).
    """

    @staticmethod
    def __new__(cls, *, shape: torch.Size, dtype: torch.dtype, **fields: Any) -> QuantizedTensor:
        unknown = set(fields) - set(cls.component_names) - set(cls.attribute_names)
        missing = set(cls.attribute_names) - set(fields)
        if unknown or missing:
            raise TypeError(
                f"{cls.__name__}: unknown fields {sorted(unknown)}, missing {sorted(missing)}; "
                f"components are {cls.component_names}, attributes {cls.attribute_names}."
            )
        first = next(fields[name] for name in cls.component_names if fields.get(name) is not None)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=first.device, requires_grad=False
        )
        for name in cls.component_names:
            setattr(self, name, fields.get(name))
        for name in cls.attribute_names:
            setattr(self, name, fields[name])
        return self

    def _attributes(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.attribute_names}

    def __init__(self, **kwargs: Any) -> None:
        pass

    def __repr__(self) -> str:  # type: ignore[override]
        parts = ", ".join(
            f"{name}={tuple(t.shape)}:{t.dtype}"
            for name, t in zip(self.component_names, self.get_data_tensors())
            if t is not None
        )
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, {parts})"

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        present = [
            n for n, t in zip(self.component_names, self.get_data_tensors()) if t is not None
        ]
        return present, {"shape": self.shape, "dtype": self.dtype, **self._attributes()}

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: dict[str, Any], outer_size: Any, outer_stride: Any
    ) -> QuantizedTensor:
        return cls(**ctx, **inner)

    def map_components(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """A tensor of the same class and metadata holding ``fn`` of each component."""
        components = {
            name: None if t is None else fn(t)
            for name, t in zip(self.component_names, self.get_data_tensors())
        }
        return type(self)(shape=self.shape, dtype=self.dtype, **self._attributes(), **components)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return dispatch(func, tuple(args), kwargs or {})


# The handled ops: NOTE [The op table of quantized tensors] in ops.py.


@implements(aten.detach.default, aten.alias.default)
def _share_components(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0].map_components(lambda t: t)


@implements(aten.is_pinned.default)
def _is_pinned(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    components = [t for t in args[0].get_data_tensors() if t is not None]
    return all(func(t, *args[1:], **kwargs) for t in components)


@implements(aten._pin_memory.default)
def _pin_memory(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0].map_components(lambda t: func(t, *args[1:], **kwargs))


_MOVE_OPTIONS = ("device", "non_blocking", "pin_memory")


@implements(aten._to_copy.default)
def _to_copy(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A move keeps the tensor quantized; a dtype conversion dequantizes."""
    q = args[0]
    if kwargs.get("dtype") not in (None, q.dtype):
        return func(q.dequantize(), **kwargs)
    changes = {
        key: value
        for key, value in kwargs.items()
        if key not in _MOVE_OPTIONS + ("dtype",)
        and not (key == "layout" and value == q.layout)
        and not (key == "memory_format" and value == torch.preserve_format)
    }
    if changes:
        call = ", ".join(f"{key}={value}" for key, value in changes.items())
        refuse(
            func,
            args,
            kwargs,
            f".to({call}) would change how the quantized data is laid out; a quantized "
            "tensor can only move it (device, non_blocking, pin_memory) or convert its "
            "dtype, which dequantizes.",
        )
    options = {key: kwargs[key] for key in _MOVE_OPTIONS if key in kwargs}
    return q.map_components(lambda t: func(t, **options))
