"""Where in a layer each saved tensor was saved: the census of choices per submodule.

:class:`Where` records, while :func:`~cpu_offload.plan.census.measure_layer` runs a
layer, which of its submodules were running when autograd saved each tensor, so that the
census can apply ``modules=`` as the offloader does (NOTE [Choices finer than a layer]:
the innermost named submodule decides) and report bytes, FLOPs and recompute cost per
submodule and per kind of operation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..module_choices import KEEP, choice_of

__all__ = ["KEPT_BY_MODULES", "Where", "saved_by", "tensor_kind"]

#: why a saved tensor stays, in the census, when ``modules=`` keeps it
KEPT_BY_MODULES = "modules= keep"


class Where:
    """The submodules of ``layer`` running at each save (innermost last), in order.

    Attributes:
        layer: the layer measured.
        saves: one tuple of modules per tensor saved while :meth:`recording`.
    """

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.stack: list[nn.Module] = []
        self.saves: list[tuple[nn.Module, ...]] = []

    def note(self) -> None:
        """A tensor is being saved now."""
        self.saves.append(tuple(self.stack))

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Track the submodules' calls (forward pre- and post-hooks) inside the block."""
        handles = []

        def enter(module: nn.Module, args: Any) -> None:
            self.stack.append(module)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] is module:
                self.stack.pop()

        for path, module in self.layer.named_modules():
            if path:
                handles.append(module.register_forward_pre_hook(enter))
                handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.stack.clear()

    def kept(self, choices: Mapping[nn.Module, str], rest: str) -> list[bool]:
        """Per save, whether ``modules=`` (resolved: ``choices``, ``rest``) keeps it."""
        return [choice_of(enclosing, choices, rest) == KEEP for enclosing in self.saves]


def saved_by(
    saved: list[torch.Tensor], where: Where, activations: set[int]
) -> tuple[dict[str, int], dict[str, int]]:
    """Activation bytes (unique storages among ``activations``, by the first save of
    each) per innermost submodule path (``""``: the layer's own code) and per kind of
    operation (:func:`tensor_kind`)."""
    names = {module: path for path, module in where.layer.named_modules()}
    by_module: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    seen: set[int] = set()
    for tensor, enclosing in zip(saved, where.saves):
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in activations or key in seen:
            continue
        seen.add(key)
        path = names.get(enclosing[-1], "") if enclosing else ""
        kind = tensor_kind(tensor, enclosing)
        by_module[path] = by_module.get(path, 0) + storage.nbytes()
        by_kind[kind] = by_kind.get(kind, 0) + storage.nbytes()
    return by_module, by_kind


def tensor_kind(tensor: torch.Tensor, enclosing: tuple[nn.Module, ...]) -> str:
    """The kind of operation that made a saved tensor (through views and reshapes):
    ``"matmul"``, ``"attention"`` (an attention kernel, or a softmax), ``"norm"`` (made
    inside a normalization module, or by a norm kernel), ``"elementwise"``, or
    ``"input"`` (a leaf: the layer's input, a table)."""
    node = tensor.grad_fn if tensor._base is None else tensor._base.grad_fn
    node = tensor.grad_fn or node
    while node is not None and any(v in node.name() for v in _RESHAPES) and node.next_functions:
        node = node.next_functions[0][0]
    if node is None or node.name() == "torch::autograd::AccumulateGrad":
        return "input"
    name = node.name().lower()
    if "attention" in name or "softmax" in name:
        return "attention"
    if any(m in name for m in ("mmbackward", "addmm", "bmm", "matmul", "linear")):
        return "matmul"
    if "norm" in name or any("norm" in type(m).__name__.lower() for m in enclosing[-1:]):
        return "norm"
    return "elementwise"


#: autograd nodes that only lay a tensor out otherwise (the kind is their input's)
_RESHAPES = ("View", "Transpose", "TBackward", "Permute", "Expand", "Slice", "Select", "Split")
