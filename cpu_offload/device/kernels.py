"""Which kernels a device runs where the meta device would run others.

On the meta device ``scaled_dot_product_attention`` runs its math implementation, which
saves the ``s x s`` attention probabilities for backward, and dropout saves a mask in the
input's dtype.  A GPU or an NPU runs a fused attention kernel (flash, or the efficient
kernel when there is a mask) and fused dropout (a 1-byte mask).  :class:`DeviceKernels`
routes those calls to the kernels the device runs, so that shapes-only runs save what a
device run saves: the planner's census measures layers under it (``plan/census.py``), and
the modeled runtime runs whole programs under it (``cpu_offload.testing.timed_runtime``),
through :meth:`DeviceKernels.patched`: torch-function modes do not reach a checkpointed
layer's recompute inside backward, and the recompute must run the kernels its forward ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

__all__ = ["ATTENTIONS", "DeviceKernels"]

#: how ``scaled_dot_product_attention`` is measured: ``"flash"``, CUDA's flash kernel
#: (the efficient kernel when there is a mask): q, k, v, the output and a float32
#: log-sum-exp per row, O(s); ``"cpu"``, the CPU's flash kernel (what a CPU run saves);
#: ``"math"``, the math implementation (the s x s probabilities among what it saves).
ATTENTIONS = ("flash", "cpu", "math")
_SDPA, _DROPOUT = F.scaled_dot_product_attention, F.dropout


class DeviceKernels(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to the chosen kernel's meta function, so
    that autograd saves what that kernel's backward needs, and dropout to the fused
    kernel where ``fused_dropout``.

    Args:
        attention: one of :data:`ATTENTIONS`.
        fused_dropout: dropout as GPUs and NPUs run it (a 1-byte mask saved).

    Attributes:
        uncounted: ``(q, k, v)`` shapes of attentions run as a kernel that
            ``torch.utils.flop_counter`` has no formula for (the CPU's flash kernel).
    """

    def __init__(self, attention: str, fused_dropout: bool) -> None:
        super().__init__()
        self.attention = attention
        self.fused_dropout = fused_dropout
        self.uncounted: list[tuple[torch.Size, torch.Size, torch.Size]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.run(func, args, kwargs or {})

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """The same routing without a mode: ``torch.nn.functional``'s attention and
        dropout replaced inside the block (everywhere: every thread, backward too)."""

        def routed(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                return self.run(original, args, kwargs)

            return call

        saved = {"scaled_dot_product_attention": _SDPA, "dropout": _DROPOUT}
        for name, original in saved.items():
            setattr(F, name, routed(original))
        try:
            yield
        finally:
            for name, original in saved.items():
                setattr(F, name, original)

    def run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, or the device's kernel in its place."""
        if func is _DROPOUT and self.fused_dropout:
            given = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            p, training = given.get("p", 0.5), given.get("training", True)
            if training and 0 < p < 1 and not given.get("inplace", False):
                # GPUs and NPUs run the fused kernel, which saves a 1-byte mask.
                return torch.ops.aten.native_dropout(given["input"], p, True)[0]
            return func(*args, **kwargs)
        if func is not _SDPA or self.attention == "math":
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = dict(zip(names, args), **kwargs)
        q, k, v = given["query"], given["key"], given["value"]
        mask, dropout = given.get("attn_mask"), given.get("dropout_p", 0.0)
        causal, scale = given.get("is_causal", False), given.get("scale")
        aten = torch.ops.aten
        if self.attention == "cpu" and not _cpu_runs_flash(q, k, v, mask, dropout, causal, given):
            return func(*args, **kwargs)  # the math implementation, as on the meta device
        if self.attention == "cpu":
            self.uncounted.append((q.shape, k.shape, v.shape))  # no FLOP formula for it
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout, causal, attn_mask=mask, scale=scale
            )[0]
        if mask is None:
            return aten._scaled_dot_product_flash_attention(
                q, k, v, dropout, causal, False, scale=scale
            )[0]
        if k.shape[-3] != q.shape[-3]:  # the efficient kernel takes no grouped heads
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask.expand(q.shape[:-1] + k.shape[-2:-1]), True, dropout, causal, scale=scale
        )[0]


def _cpu_runs_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    causal: bool,
    given: dict[str, Any],
) -> bool:
    """Whether ``scaled_dot_product_attention`` on the CPU runs its flash kernel for these
    inputs (not with dropout, for one), asked of torch's own choice on stand-ins of their
    shapes, dtypes and last strides (expanded: nothing of their size is allocated)."""

    def stand_in(tensor: torch.Tensor) -> torch.Tensor:
        last = tensor.stride(-1) if tensor.dim() else 1
        size = max(1, tensor.shape[-1] * max(1, last))
        storage = torch.empty(size, dtype=tensor.dtype, device="cpu")
        strides = (0,) * (tensor.dim() - 1) + (last,)
        return storage.as_strided(tensor.shape, strides)

    choice = torch._fused_sdp_choice(
        stand_in(q),
        stand_in(k),
        stand_in(v),
        None if mask is None else stand_in(mask),
        dropout,
        causal,
        scale=given.get("scale"),
        enable_gqa=bool(given.get("enable_gqa", False)),
    )
    return bool(choice == SDPBackend.FLASH_ATTENTION.value)
