"""``QuantizedTensor``: a quantized value with tensor semantics."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from .storage import QuantizedTensorStorage

__all__ = ["QuantizedTensor"]


class QuantizedTensor(torch.Tensor, QuantizedTensorStorage):
    """A wrapper tensor subclass holding quantized components.

    It has the shape and the nominal (high-precision) dtype of the value it stands
    for. ``detach`` and ``alias`` share the components; any other op dequantizes its
    quantized arguments and runs on plain tensors.

    Subclasses set ``component_names`` and implement :meth:`dequantize`; their
    constructor takes the components as keyword arguments plus ``shape``, ``dtype``
    and ``meta`` (format metadata, a dict).
    """

    meta: dict[str, Any]

    @staticmethod
    def __new__(
        cls, *, shape: torch.Size, dtype: torch.dtype, meta: dict[str, Any], **components: Any
    ) -> QuantizedTensor:
        first = next(t for t in components.values() if t is not None)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=first.device, requires_grad=False
        )
        for name in cls.component_names:
            setattr(self, name, components.get(name))
        self.meta = dict(meta)
        return self

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
        return type(self)(shape=self.shape, dtype=self.dtype, meta=self.meta, **components)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        present = [
            n for n, t in zip(self.component_names, self.get_data_tensors()) if t is not None
        ]
        return present, {"shape": self.shape, "dtype": self.dtype, "meta": self.meta}

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: dict[str, Any], outer_size: Any, outer_stride: Any
    ) -> QuantizedTensor:
        return cls(shape=ctx["shape"], dtype=ctx["dtype"], meta=ctx["meta"], **inner)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]._like()

        def plain(value: Any) -> Any:
            return value.dequantize() if isinstance(value, QuantizedTensor) else value

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))
