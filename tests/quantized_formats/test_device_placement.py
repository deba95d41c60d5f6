"""Quantize and dequantize keep every tensor on the input's device (checked on ``meta``).

A tensor made on the host inside these paths is a device mismatch on CUDA and NPU
(``torch.ldexp`` of host ones and device exponents) or a blocking host-to-device copy
on every call (a host scalar in ``torch.where``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from quantized.float8 import finite_amax
from quantized.mxfp8 import _dequantize_rows


class HostTensors(TorchDispatchMode):
    """Records the ops whose arguments or results include a tensor on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten((args, kwargs, out))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in flat):
            self.ops.append(str(func))
        return out


def test_mxfp8_dequantize_stays_on_the_device():
    data = torch.empty(4, 64, dtype=torch.float8_e4m3fn, device="meta")
    scale = torch.empty(4, 2, dtype=torch.uint8, device="meta")
    with HostTensors() as seen:
        out = _dequantize_rows(data, scale, 32)
    assert out.device.type == "meta" and out.shape == (4, 64)
    assert seen.ops == []


def test_float8_amax_makes_no_host_scalar():
    x = torch.empty(16, 16, device="meta")
    with HostTensors() as seen:
        finite_amax(x)
    assert seen.ops == []
