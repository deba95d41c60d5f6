"""The saving protocol: quantized data decomposes into component tensors and back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

__all__ = ["QuantizedTensorStorage", "prepare_for_saving", "restore_from_saved"]


class QuantizedTensorStorage:
    """Component tensors of a quantized value, as a plain object.

    Subclasses name their components in ``component_names``, in saving order, and
    implement :meth:`dequantize`. Metadata that is not a tensor (shape, dtype, format)
    stays on the object across :meth:`prepare_for_saving`/:meth:`restore_from_saved`.
    """

    component_names: ClassVar[tuple[str, ...]] = ()

    def get_data_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The components, in saving order (``None`` for an absent one)."""
        return tuple(getattr(self, name) for name in self.component_names)

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedTensorStorage]:
        """Hand over the components and clear them here; returns ``(components, self)``."""
        components = list(self.get_data_tensors())
        for name in self.component_names:
            setattr(self, name, None)
        return components, self

    def restore_from_saved(
        self, tensors: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Take back the first components of ``tensors``; return the rest."""
        count = len(self.component_names)
        if len(tensors) < count:
            raise ValueError(
                f"{type(self).__name__}.restore_from_saved: expected at least {count} "
                f"tensors ({', '.join(self.component_names)}), got {len(tensors)}."
            )
        for name, tensor in zip(self.component_names, tensors[:count]):
            setattr(self, name, tensor)
        return list(tensors[count:])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError


def prepare_for_saving(*tensors: Any) -> tuple[list[torch.Tensor | None], list[Any]]:
    """Decompose each argument: plain tensors (and ``None``) pass through.

    Returns the flat list of tensors to save and one object per argument (the
    storage object for quantized values, ``None`` for plain tensors).
    """
    flat: list[torch.Tensor | None] = []
    objects: list[Any] = []
    for tensor in tensors:
        if isinstance(tensor, QuantizedTensorStorage):
            components, obj = tensor.prepare_for_saving()
            flat.extend(components)
            objects.append(obj)
        else:
            flat.append(tensor)
            objects.append(None)
    return flat, objects


def restore_from_saved(objects: Sequence[Any], saved: Sequence[torch.Tensor | None]) -> list[Any]:
    """Undo :func:`prepare_for_saving`: one restored value per object."""
    restored = []
    rest = list(saved)
    for obj in objects:
        if obj is None:
            restored.append(rest.pop(0))
        else:
            rest = obj.restore_from_saved(rest)
            restored.append(obj)
    if rest:
        raise ValueError(f"restore_from_saved: {len(rest)} saved tensors were left over.")
    return restored
