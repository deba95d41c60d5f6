"""FP8 with one scale per tensor (current scaling)."""

from __future__ import annotations

import torch

from .storage import Component
from .tensor import QuantizedTensor

__all__ = ["FP8_DTYPES", "Float8Quantizer", "Float8Tensor", "finite_amax"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_fp8_dtype(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"quantized: fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}.")


def finite_amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Largest finite magnitude (infinities and NaN ignored), in float32."""
    magnitude = torch.where(torch.isfinite(x), x.abs(), x.new_zeros(()))  # no host scalar
    return magnitude.amax() if dim is None else magnitude.amax(dim)


class Float8Tensor(QuantizedTensor):
    """``_data * _scale_inv`` approximates the value; ``_transpose`` is an optional
    column-wise copy of ``_data`` (the last dimension first, leading dimensions
    flattened), for the matmuls of backward. Components in saving order:
    ``[data, transpose, scale_inv]``."""

    _data: Component
    _transpose: Component
    _scale_inv: Component
    fp8_dtype: torch.dtype

    def data_and_scale_inv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 data and its inverse scale (raises once handed over for saving)."""
        if self._data is None or self._scale_inv is None:
            raise RuntimeError("Float8Tensor: the data was handed over by prepare_for_saving.")
        return self._data, self._scale_inv

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        data, scale_inv = self.data_and_scale_inv()
        return (data.float() * scale_inv).to(dtype or self.dtype)


class Float8Quantizer:
    """Per-tensor current scaling: ``scale = fp8_max / amax``.

    ``amax`` is the largest finite magnitude; values saturate to ``±fp8_max``
    (infinities too), NaN stays NaN, an all-zero tensor gets scale 1. Rounding is to
    nearest, ties to even (PyTorch's cast).

    Args:
        fp8_dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        columnwise: also keep the transposed data.
    """

    def __init__(
        self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, columnwise: bool = False
    ) -> None:
        check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.columnwise = columnwise
        self.fp8_max = torch.finfo(fp8_dtype).max

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        if not x.is_floating_point():
            raise TypeError(f"Float8Quantizer.quantize: expected a floating tensor, got {x.dtype}.")
        values = x.detach().float()
        amax = finite_amax(values)
        # torch.div rounds correctly; float / tensor would go through reciprocal().
        scale = torch.where(amax > 0, torch.div(torch.full_like(amax, self.fp8_max), amax), 1.0)
        data = (values * scale).clamp(-self.fp8_max, self.fp8_max).to(self.fp8_dtype)
        transpose = None
        if self.columnwise:
            transpose = data.reshape(-1, data.shape[-1]).t().contiguous()
        return Float8Tensor(
            shape=x.shape,
            dtype=x.dtype,
            fp8_dtype=self.fp8_dtype,
            _data=data,
            _transpose=transpose,
            # torch.div rounds correctly; 1.0 / scale would go through reciprocal().
            _scale_inv=torch.div(torch.ones_like(scale), scale),
        )
