"""Layers that save quantized activations for backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpu_offload.device.runtime import supports_fp8_matmul

from .float8 import Float8Quantizer, Float8Tensor
from .tensor import QuantizedTensor

__all__ = ["QuantizedLinear", "quantized_linear"]

_WEIGHT_QUANTIZER = Float8Quantizer(torch.float8_e4m3fn)


def _fp8_matmul(qx: Float8Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch._scaled_mm`` with a per-tensor FP8 weight (accelerators that support it)."""
    qw = _WEIGHT_QUANTIZER.quantize(weight)
    x_data, x_scale_inv = qx.data_and_scale_inv()
    w_data, w_scale_inv = qw.data_and_scale_inv()
    out = torch._scaled_mm(
        x_data.reshape(-1, qx.shape[-1]),
        w_data.t(),
        scale_a=x_scale_inv,
        scale_b=w_scale_inv,
        bias=bias,
        out_dtype=qx.dtype,
    )
    return out.reshape(*qx.shape[:-1], weight.shape[0])


def _use_scaled_mm(qx: QuantizedTensor, weight: torch.Tensor) -> bool:
    return (
        isinstance(qx, Float8Tensor)
        and qx.fp8_dtype == torch.float8_e4m3fn
        and qx.dtype in (torch.bfloat16, torch.float16)
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
        and supports_fp8_matmul(weight.device)
    )


class _QuantizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, quantizer: Any):
        qx = quantizer.quantize(x)
        if _use_scaled_mm(qx, weight):
            out = _fp8_matmul(qx, weight, bias)
        else:
            out = F.linear(qx.dequantize(), weight, bias)
        ctx.save_for_backward(qx, weight)  # the quantized input, not the original
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        qx, weight = ctx.saved_tensors
        x = qx.dequantize()
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = grad @ weight
        grad_weight = grad_2d.t() @ x.reshape(-1, x.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def quantized_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quantizer: Any
) -> torch.Tensor:
    """``F.linear`` on the quantized input; backward uses the saved quantized input
    (straight-through for the input gradient)."""
    return _QuantizedLinearFunction.apply(x, weight, bias, quantizer)


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose input is quantized with ``quantizer`` and saved quantized.

    Example:
        >>> import torch
        >>> from quantized import MXFP8Quantizer, QuantizedLinear
        >>> layer = QuantizedLinear(64, 32, quantizer=MXFP8Quantizer())
        >>> layer(torch.randn(4, 64, requires_grad=True)).sum().backward()
        >>> layer.weight.grad.shape
        torch.Size([32, 64])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        quantizer: Any,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.quantizer = quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias, self.quantizer)
