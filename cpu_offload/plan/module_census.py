"""Where in a layer each saved tensor was saved: the census of choices per submodule.

:class:`Where` records, while :func:`~cpu_offload.plan.census.measure_layer` runs a
layer, which of its submodules were running when autograd saved each tensor, so that the
census can apply ``modules=`` as the offloader does (NOTE [Choices finer than a layer]:
the innermost named submodule decides) and report bytes, FLOPs and recompute cost per
submodule and per kind of operation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..device.profiles import DeviceProfile
from ..policy.module_choices import KEEP, choice_of

__all__ = [
    "PartCost",
    "Where",
    "attention_site",
    "costs_by",
    "kernel_kind",
    "offloaded_unpacks",
    "saved_by",
    "tensor_kind",
]


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
        self.paths = {module: path for path, module in layer.named_modules()}

    def site(self, func: Any) -> tuple[str, str]:
        """``(innermost submodule path, kind)`` of an operator running now
        (:func:`kernel_kind`; ``""``: the layer's own code)."""
        path = self.paths.get(self.stack[-1], "") if self.stack else ""
        return path, kernel_kind(func, self.stack[-1:])

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
    names = where.paths
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


def kernel_kind(func: Any, enclosing: Sequence[nn.Module]) -> str:
    """The kind of a kernel, named as :func:`tensor_kind` names what it saves:
    ``"attention"`` (an attention kernel or a softmax), ``"matmul"``, ``"norm"`` (a norm
    kernel, or any kernel inside a normalization module), or ``"elementwise"``."""
    name = str(func).lower()
    if "attention" in name or "softmax" in name:
        return "attention"
    if any(m in name for m in (".mm.", ".addmm.", ".bmm.", ".baddbmm.", "matmul", "linear")):
        return "matmul"
    if "norm" in name or any("norm" in type(m).__name__.lower() for m in enclosing):
        return "norm"
    return "elementwise"


def attention_site(sites: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """Where the FLOPs of attentions without a formula (added after the forward) go:
    to the first attention kernel's submodule."""
    return next((site for site in sites if site[1] == "attention"), ("", "attention"))


class _Measured(Protocol):
    """What :func:`costs_by` reads of a :class:`~cpu_offload.plan.census.LayerProfile`."""

    saved_by_module: dict[str, int]
    saved_by_kind: dict[str, int]
    forward_kernels: list[tuple[int, int]]
    recompute_kernels: list[tuple[int, int]]
    forward_sites: list[tuple[str, str]]


@dataclass
class PartCost:
    """One part of a layer (a submodule, or a kind of operation): what it saves and
    what it costs.

    Attributes:
        saved_bytes: activation bytes saved there (``saved_by_module`` or ``_kind``).
        forward_flops: FLOPs of its forward kernels.
        forward_kernels: how many kernels its forward launches.
        recompute_kernels: ``(flops, bytes)`` of its kernels that a checkpointed layer
            runs again in backward.
        recompute_s: their time on the device profile given (the sum of its
            ``kernel_seconds``; 0.0 without a profile).
    """

    saved_bytes: int = 0
    forward_flops: int = 0
    forward_kernels: int = 0
    recompute_kernels: list[tuple[int, int]] = field(default_factory=list)
    recompute_s: float = 0.0

    @property
    def recompute_flops(self) -> int:
        return sum(f for f, _ in self.recompute_kernels)


def costs_by(
    profile: _Measured, by: str = "module", device: DeviceProfile | None = None
) -> dict[str, PartCost]:
    """A measured layer split into parts, ``by="module"`` (innermost submodule path,
    ``""`` for the layer's own code) or ``by="kind"``.  The parts add up to the layer:
    saved bytes to ``saved_bytes``, FLOPs to ``forward_flops``, kernels and recompute
    kernels to the layer's lists, recompute seconds to the sum of the profile's
    ``kernel_seconds`` over ``recompute_kernels`` (what ``compute_seconds`` charges
    unless the host's issue time is longer).

    Example:
        >>> import torch
        >>> from cpu_offload.plan import measure_layer
        >>> from cpu_offload.plan.module_census import costs_by
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU())
        >>> layer = measure_layer(make, torch.empty(8, 64, device="meta"), min_offload_numel=0)
        >>> parts = costs_by(layer, "kind")
        >>> sorted(parts), parts["matmul"].forward_flops  # 2 * 8 * 64 * 256
        (['elementwise', 'input', 'matmul'], 262144)
    """
    if by not in ("module", "kind"):
        raise ValueError(f"costs_by: by must be 'module' or 'kind', got {by!r}.")
    if len(profile.forward_sites) != len(profile.forward_kernels):
        raise ValueError(
            "costs_by: the profile has no site per forward kernel; measure it with "
            "cpu_offload.plan.measure_layer."
        )
    index = 0 if by == "module" else 1
    saved = profile.saved_by_module if by == "module" else profile.saved_by_kind
    parts = {name: PartCost(saved_bytes=n) for name, n in saved.items()}
    recomputed = len(profile.recompute_kernels)
    for position, (kernel, site) in enumerate(zip(profile.forward_kernels, profile.forward_sites)):
        part = parts.setdefault(site[index], PartCost())
        part.forward_flops += kernel[0]
        part.forward_kernels += 1
        if position < recomputed:
            part.recompute_kernels.append(kernel)
    if device is not None:
        for part in parts.values():
            part.recompute_s = math.fsum(device.kernel_seconds(*k) for k in part.recompute_kernels)
    return parts


def offloaded_unpacks(
    saved: list[torch.Tensor], rows: list[tuple[Any, str, str]], first_unpacks: dict[int, int]
) -> list[tuple[int, int, int]]:
    """``LayerProfile.offloaded_unpacks``: per storage of the ``saved`` tensors the
    census offloads (``rows``), in pack order, its bytes, how many backward kernels ran
    before any tensor of it was first unpacked, and that unpack's rank among the first
    unpacks (``first_unpacks``: by saved index, in unpack order)."""
    rank = {index: number for number, index in enumerate(first_unpacks)}
    never = (max(first_unpacks.values(), default=0), len(rank))
    firsts: dict[int, list[Any]] = {}  # storage -> [bytes, (first unpack, rank)]
    for index, (tensor, row) in enumerate(zip(saved, rows)):
        if row[2] != "offloaded":
            continue
        at = (first_unpacks[index], rank[index]) if index in rank else never
        entry = firsts.setdefault(tensor.untyped_storage()._cdata, [0, at])
        entry[0] = max(entry[0], tensor.numel() * tensor.element_size())
        entry[1] = min(entry[1], at)
    return [(nbytes, at[0], at[1]) for nbytes, at in firsts.values()]
