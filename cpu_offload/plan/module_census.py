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

__all__ = ["KEPT_BY_MODULES", "Where"]

#: why a saved tensor stays, in the census, when ``modules=`` keeps it
KEPT_BY_MODULES = "modules= keep"


class Where:
    """The submodules of ``layer`` running at each save (innermost last), in order.

    Attributes:
        layer: the layer measured.
        saves: one tuple of modules per tensor saved while :meth:`recording`.
        kernels_in: per submodule, the indices of the forward kernels launched while it
            was innermost (filled by :meth:`note_kernel`).
    """

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.stack: list[nn.Module] = []
        self.saves: list[tuple[nn.Module, ...]] = []
        self.kernels_in: dict[nn.Module, list[int]] = {}

    def note(self) -> None:
        """A tensor is being saved now."""
        self.saves.append(tuple(self.stack))

    def note_kernel(self, index: int) -> None:
        """Forward kernel ``index`` is being launched now."""
        if self.stack:
            self.kernels_in.setdefault(self.stack[-1], []).append(index)

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


def tensor_kind(tensor: torch.Tensor, enclosing: tuple[nn.Module, ...]) -> str:
    """The kind of operation that made a saved tensor: ``"matmul"``, ``"attention"``,
    ``"norm"`` (saved inside a normalization module, or made by a norm kernel),
    ``"elementwise"``, or ``"input"`` (the layer's input, a leaf)."""
    made = tensor
    while made.grad_fn is not None and made._base is not None and _is_view(made.grad_fn.name()):
        made = made._base
    node = made.grad_fn
    if node is None:
        return "input"
    name = node.name().lower()
    if "attention" in name:
        return "attention"
    if any(m in name for m in ("mmbackward", "addmm", "bmm", "matmul", "linear", "baddbmm")):
        return "matmul"
    if "norm" in name or any("norm" in type(m).__name__.lower() for m in enclosing[-1:]):
        return "norm"
    return "elementwise"


def _is_view(name: str) -> bool:
    return any(v in name for v in ("View", "Transpose", "Permute", "Expand", "Slice", "Select"))
