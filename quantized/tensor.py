"""``QuantizedTensor``: a quantized value with tensor semantics."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from .storage import QuantizedTensorStorage

__all__ = ["QuantizedTensor"]


# dequantize(dtype=None) widens torch.Tensor.dequantize(); the dispatch signature is torch's.
class QuantizedTensor(torch.Tensor, QuantizedTensorStorage):  # type: ignore[misc]
    """A wrapper tensor subclass holding quantized components.

    It has the shape and the nominal (high-precision) dtype of the value it stands
    for. ``detach`` and ``alias`` share the components; ``.to(device)``/``.cpu()`` and
    ``pin_memory()`` move or pin the components and stay quantized; ``is_pinned()``
    asks the components.  An op that would modify a quantized tensor in place
    (``add_``, ``zero_``, ``copy_`` into it, ``out=``) raises: the components cannot
    hold an arbitrary new value.  Any other op dequantizes its quantized arguments and
    runs on plain tensors.

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

    def _like(self) -> QuantizedTensor:
        components = dict(zip(self.component_names, self.get_data_tensors()))
        return type(self)(shape=self.shape, dtype=self.dtype, **self._attributes(), **components)

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

    def _map_components(self, fn: Any) -> QuantizedTensor:
        components = {
            name: None if t is None else fn(t)
            for name, t in zip(self.component_names, self.get_data_tensors())
        }
        return type(self)(shape=self.shape, dtype=self.dtype, **self._attributes(), **components)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]._like()
        if func is torch.ops.aten.is_pinned.default:
            return all(t.is_pinned() for t in args[0].get_data_tensors() if t is not None)
        if func is torch.ops.aten._pin_memory.default:
            return args[0]._map_components(lambda t: t.pin_memory())
        if func is torch.ops.aten._to_copy.default:
            moved = _move_components(args[0], kwargs)
            if moved is not None:
                return moved
        _refuse_in_place(func, args, kwargs)

        def plain(value: Any) -> Any:
            return value.dequantize() if isinstance(value, QuantizedTensor) else value

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def _move_components(q: QuantizedTensor, kwargs: dict[str, Any]) -> QuantizedTensor | None:
    """``q.to(device)`` as a quantized tensor; ``None`` when the call also converts."""
    if set(kwargs) - {"device", "non_blocking", "dtype", "layout", "pin_memory"}:
        return None  # memory_format and the like: dequantize
    if kwargs.get("dtype") not in (None, q.dtype) or kwargs.get("layout") not in (None, q.layout):
        return None
    options = {
        key: kwargs[key] for key in ("device", "non_blocking", "pin_memory") if key in kwargs
    }
    return q._map_components(lambda t: torch.ops.aten._to_copy(t, **options))


def _refuse_in_place(func: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """Raise when ``func`` writes into a quantized tensor."""
    schema = func._schema
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, QuantizedTensor):
            op = f"{schema.name}.{schema.overload_name or 'default'}"
            raise NotImplementedError(
                f"{type(value).__name__} does not support {op}: it would modify the "
                "quantized tensor in place, which its components cannot represent. "
                "Dequantize it first (q.dequantize()) and modify the plain tensor, or "
                "quantize the new value with the quantizer."
            )
