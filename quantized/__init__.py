"""Quantized tensor formats that decompose themselves for saving.

The offloader moves them through the two-method protocol
(``prepare_for_saving``/``restore_from_saved``) without knowing their internals.
"""

from __future__ import annotations

from .float8 import Float8Quantizer, Float8Tensor
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor
from .nn import QuantizedLinear, quantized_linear
from .storage import QuantizedTensorStorage, prepare_for_saving, restore_from_saved
from .tensor import QuantizedTensor

__all__ = [
    "Float8Quantizer",
    "Float8Tensor",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "QuantizedLinear",
    "QuantizedTensor",
    "QuantizedTensorStorage",
    "prepare_for_saving",
    "quantized_linear",
    "restore_from_saved",
]
