"""Tensor groups: what a layer copies, and the processing that shrinks it.

Before a layer's tensors are copied to the host, :class:`TensorGroupProcessor`
replaces views by their base and copies each distinct tensor once; after reload it
undoes both steps, so that every popped tensor has the values, shape, stride,
storage offset and dtype that were pushed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .marks import TensorMarks, marks_of

__all__ = [
    "AUTO_BASE_MAX_RATIO",
    "GroupLayout",
    "TensorGroup",
    "TensorGroupProcessor",
    "is_dense",
    "offloads_through_base",
]

ViewSpec = tuple[torch.Size, tuple[int, ...], int]

#: a view that cannot be copied by itself moves through its base, unasked, when the
#: base has at most this many times its elements; a larger base would cost more link
#: bandwidth and host memory than the view is worth (mark it to move it anyway).
AUTO_BASE_MAX_RATIO = 4


@dataclass
class TensorGroup:
    """Tensors of one layer, with one event (or ``None``) per tensor.

    Attributes:
        tensor_list: the tensors.
        events: for tensors on the device before offload, the event after which they
            may be read (``None``: the layer's own event covers it); after reload, the
            event after which they are filled.
        aux: the :class:`GroupLayout` needed to undo group processing.
        via_base: the positions of the views that move through their base, as the
            layer decided when they were pushed; ``None``: decided by
            :func:`offloads_through_base` when the group is processed.
    """

    tensor_list: list[torch.Tensor] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    aux: GroupLayout | None = None
    via_base: set[int] | None = None

    def append(self, tensor: torch.Tensor, event: Any) -> int:
        self.tensor_list.append(tensor)
        self.events.append(event)
        return len(self.tensor_list) - 1

    def __len__(self) -> int:
        return len(self.tensor_list)


@dataclass
class GroupLayout:
    """How a processed group maps back to the pushed tensors.

    Attributes:
        views: per pushed position, ``(shape, stride, storage_offset)`` of the view
            that was replaced by its base, or ``None``; the offset is counted from
            the base's first element (the base comes back at offset 0).
        source_index: per pushed position, the index of its unique tensor.
    """

    views: list[ViewSpec | None]
    source_index: list[int]


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether the elements of ``tensor`` fill a block of memory exactly once.

    Contiguous tensors and permutations of them (a transposed SDPA output, say)
    are dense; such a tensor is copied with its own strides, exactly.
    """
    if tensor.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(tensor.shape, tensor.stride()) if s != 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def offloads_through_base(tensor: torch.Tensor, marks: TensorMarks | None = None) -> bool:
    """Whether ``tensor`` is a view that is copied through its base.

    True when the view reads the base's bits as they are (same dtype, not ``z.real``
    of a complex ``z``; no conjugate or negative bit of its own) and either the user
    marked it with ``start_offload(..., offload_base_tensor=True)``, or the base has
    exactly as many elements (a pure re-stride), or the view cannot be copied by itself
    (it is not dense) and its base is at most :data:`AUTO_BASE_MAX_RATIO` times larger:
    q, k and v of one fused qkv output, the two halves of a SwiGLU input.  A base is
    copied once for all its views in a layer.
    """
    base = tensor._base
    if base is None or base.dtype != tensor.dtype or base.layout is not torch.strided:
        return False
    if base.is_conj() != tensor.is_conj() or base.is_neg() != tensor.is_neg():
        return False
    if marks is None:
        marks = marks_of(tensor)
    if marks is not None and marks.offload_base:
        return True
    numel = tensor.numel()
    if base.numel() == numel:
        return True
    return base.numel() <= AUTO_BASE_MAX_RATIO * numel and not is_dense(tensor)


class TensorGroupProcessor:
    """Group processing before offload and its undo after reload."""

    @staticmethod
    def process_before_offload(group: TensorGroup) -> TensorGroup:
        """Views to bases, then one entry per distinct tensor; returns a new group."""
        views: list[ViewSpec | None] = []
        source_index: list[int] = []
        unique = TensorGroup()
        index_of: dict[int, int] = {}
        via_base = group.via_base
        for position, (tensor, event) in enumerate(zip(group.tensor_list, group.events)):
            if (
                position in via_base
                if via_base is not None
                else tensor._base is not None and offloads_through_base(tensor)
            ):
                base = cast(torch.Tensor, tensor._base)
                offset = int(tensor.storage_offset() - base.storage_offset())
                views.append((tensor.shape, tensor.stride(), offset))
                tensor = base
            else:
                views.append(None)
            key = id(tensor)
            if key in index_of:
                # Keep the latest ready event: the copy waits for every push.
                if event is not None:
                    unique.events[index_of[key]] = event
            else:
                index_of[key] = unique.append(tensor, event)
            source_index.append(index_of[key])
        unique.aux = GroupLayout(views=views, source_index=source_index)
        return unique

    @staticmethod
    def process_after_reload(group: TensorGroup) -> TensorGroup:
        """Undo :meth:`process_before_offload` on the reloaded group."""
        layout = group.aux
        if layout is None:
            raise ValueError("TensorGroupProcessor: the group has no layout to undo.")
        restored = TensorGroup(aux=layout)
        for position, index in enumerate(layout.source_index):
            tensor = group.tensor_list[index]
            view = layout.views[position]
            if view is not None:
                tensor = tensor.as_strided(*view)
            restored.append(tensor, group.events[index])
        return restored
