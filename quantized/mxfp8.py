"""MXFP8: OCP Microscaling (MX) v1.0 block scaling with power-of-two E8M0 scales."""

from __future__ import annotations

import torch

from .float8 import check_fp8_dtype, finite_amax
from .storage import Component
from .tensor import QuantizedTensor

__all__ = ["MXFP8Quantizer", "MXFP8Tensor"]

# Largest exponent of a normal element value (OCP MX v1.0, table 1): E4M3 448 = 1.75*2^8,
# E5M2 57344 = 1.75*2^15.
_EMAX_ELEM = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_E8M0_BIAS = 127


def _quantize_rows(
    x: torch.Tensor, block_size: int, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``block_size`` along the last dim of a 2-D float32 tensor."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // block_size, block_size)
    amax = finite_amax(blocks, dim=-1)
    # floor(log2(amax)) exactly: amax = m * 2**e with m in [0.5, 1).
    _, exponent = torch.frexp(amax)
    shared = (exponent.to(torch.int32) - 1 - _EMAX_ELEM[fp8_dtype]).clamp(-127, 127)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -127))
    scale = torch.ldexp(torch.ones_like(amax), shared)
    fp8_max = torch.finfo(fp8_dtype).max
    data = (blocks / scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return data.reshape(rows, cols), (shared + _E8M0_BIAS).to(torch.uint8)


def _dequantize_rows(data: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    rows, cols = data.shape
    exponent = scale.to(torch.int32) - _E8M0_BIAS
    factor = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    blocks = data.float().reshape(rows, cols // block_size, block_size)
    return (blocks * factor.unsqueeze(-1)).reshape(rows, cols)


class MXFP8Tensor(QuantizedTensor):
    """Row-wise data with one E8M0 scale (a ``uint8`` biased exponent) per block of the
    last dimension; optionally a column-wise copy (blocks along the flattened leading
    dimensions, stored transposed). Components in saving order: ``[rowwise_data,
    columnwise_data, rowwise_scale_inv, columnwise_scale_inv]``."""

    _rowwise_data: Component
    _columnwise_data: Component
    _rowwise_scale_inv: Component
    _columnwise_scale_inv: Component
    fp8_dtype: torch.dtype
    block_size: int

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        block = self.block_size
        last = self.shape[-1]
        if self._rowwise_data is not None and self._rowwise_scale_inv is not None:
            value = _dequantize_rows(
                self._rowwise_data.reshape(-1, last),
                self._rowwise_scale_inv.reshape(-1, last // block),
                block,
            )
        elif self._columnwise_data is not None and self._columnwise_scale_inv is not None:
            value = _dequantize_rows(self._columnwise_data, self._columnwise_scale_inv, block).t()
        else:
            raise RuntimeError("MXFP8Tensor: the data was handed over by prepare_for_saving.")
        return value.reshape(self.shape).to(dtype or self.dtype)


class MXFP8Quantizer:
    """OCP MX v1.0 quantization: per block of ``block_size`` elements along the last
    dimension, ``X = 2**(floor(log2(amax)) - emax_elem)`` and elements ``x / X`` cast to
    FP8 with saturation (round to nearest, ties to even).

    ``amax`` ignores infinities and NaN; infinities saturate, NaN stays NaN in its
    element; an all-zero block gets the smallest scale, ``2**-127``. The last dimension
    (and, with ``columnwise``, the product of the leading ones) must be a multiple of
    ``block_size``: pad the input, there is no implicit padding.

    Args:
        fp8_dtype: element format, E4M3 (``torch.float8_e4m3fn``) or E5M2.
        block_size: elements per scale (32 in the spec).
        columnwise: also quantize the transpose, for the matmuls of backward.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        block_size: int = 32,
        columnwise: bool = False,
    ) -> None:
        check_fp8_dtype(fp8_dtype)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"MXFP8Quantizer: block_size must be an int >= 1, got {block_size!r}.")
        self.fp8_dtype = fp8_dtype
        self.block_size = block_size
        self.columnwise = columnwise

    def quantize(self, x: torch.Tensor) -> MXFP8Tensor:
        if not x.is_floating_point():
            raise TypeError(f"MXFP8Quantizer.quantize: expected a floating tensor, got {x.dtype}.")
        if x.dim() == 0 or x.shape[-1] % self.block_size:
            raise ValueError(
                f"MXFP8Quantizer: the last dimension ({x.shape[-1] if x.dim() else 'scalar'}) "
                f"must be a multiple of block_size={self.block_size}; pad the input."
            )
        values = x.detach().float().reshape(-1, x.shape[-1])
        rowwise, rowwise_scale = _quantize_rows(values, self.block_size, self.fp8_dtype)
        columnwise = columnwise_scale = None
        if self.columnwise:
            if values.shape[0] % self.block_size:
                raise ValueError(
                    f"MXFP8Quantizer(columnwise=True): the leading dimensions "
                    f"({values.shape[0]} rows) must be a multiple of block_size="
                    f"{self.block_size}; pad the input."
                )
            columnwise, columnwise_scale = _quantize_rows(
                values.t().contiguous(), self.block_size, self.fp8_dtype
            )
        return MXFP8Tensor(
            shape=x.shape,
            dtype=x.dtype,
            fp8_dtype=self.fp8_dtype,
            block_size=self.block_size,
            _rowwise_data=rowwise.reshape(x.shape),
            _columnwise_data=columnwise,
            _rowwise_scale_inv=rowwise_scale.reshape(*x.shape[:-1], -1),
            _columnwise_scale_inv=columnwise_scale,
        )
