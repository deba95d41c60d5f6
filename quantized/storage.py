"""The saving protocol: quantized data decomposes into component tensors and back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch

__all__ = ["Component", "QuantizedTensorStorage", "prepare_for_saving", "restore_from_saved"]

#: the annotation of a component tensor (``None`` once handed over for saving)
Component = Optional[torch.Tensor]  # noqa: UP045 - the name is what marks a component


def _fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The components (annotated ``Component``) and the other typed attributes of
    ``cls`` and its bases, in declaration order, bases first."""
    components: list[str] = []
    attributes: list[str] = []
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, QuantizedTensorStorage):
            continue  # torch.Tensor's own annotations are not fields
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            text = annotation if isinstance(annotation, str) else repr(annotation)
            if text.startswith(("ClassVar", "typing.ClassVar")) or name.startswith("__"):
                continue
            target = components if annotation in ("Component", Component) else attributes
            if name not in components and name not in attributes:
                target.append(name)
    return tuple(components), tuple(attributes)


class QuantizedTensorStorage:
    """Component tensors of a quantized value, as a plain object.

    Subclasses declare their components as attributes annotated ``Component``, in
    saving order, and their format metadata as other typed attributes (``fp8_dtype:
    torch.dtype``); :attr:`component_names` and :attr:`attribute_names` are derived from
    the class. They implement :meth:`dequantize`.  Metadata stays on the object across
    :meth:`prepare_for_saving`/:meth:`restore_from_saved`.
    """

    component_names: ClassVar[tuple[str, ...]] = ()
    attribute_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.component_names, cls.attribute_names = _fields(cls)

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
