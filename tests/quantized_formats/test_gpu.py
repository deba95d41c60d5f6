"""The quantized offload tests on the accelerator, and CUDA's FP8 matmul path (marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch
from helpers import forward

from cpu_offload import get_cpu_offload_context
from cpu_offload.device.runtime import available_device_type, supports_fp8_matmul
from quantized import Float8Quantizer, MXFP8Quantizer, QuantizedLinear

pytestmark = pytest.mark.gpu
DEVICE = available_device_type()


def tanh_after(layers):
    return [lambda h, layer=layer: torch.tanh(layer(h)) for layer in layers]


def run(layers, x, offloaded):
    ctx = sync_fn = None
    if offloaded:
        ctx, sync_fn = get_cpu_offload_context(True, offloaded, len(layers))
    layers.zero_grad(set_to_none=True)
    h = forward(tanh_after(layers), x, ctx, sync_fn)
    h.float().square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()], ctx


@pytest.mark.parametrize("make", [Float8Quantizer, MXFP8Quantizer], ids=["fp8", "mxfp8"])
def test_gradients_bit_identical_on_gpu(make):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        QuantizedLinear(1024, 1024, quantizer=make()) for _ in range(4)
    ).to(DEVICE, torch.bfloat16)
    x = torch.randn(2048, 1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    expected, _ = run(layers, x, None)
    actual, ctx = run(layers, x, 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert ctx.offload_synchronizer.stats.tensors_offloaded > 0


def test_scaled_mm_is_used_where_supported(monkeypatch):
    if not supports_fp8_matmul(DEVICE):
        pytest.skip(f"{DEVICE} has no torch._scaled_mm FP8 matmul (needs CUDA 8.9+)")
    calls = []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    layer = QuantizedLinear(256, 256, quantizer=Float8Quantizer()).to(DEVICE, torch.bfloat16)
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    out = layer(x)
    assert calls and out.shape == (64, 256)
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert (out.float() - reference.float()).abs().mean() < 0.1 * reference.float().abs().mean()


@pytest.mark.parametrize("make", [Float8Quantizer, MXFP8Quantizer], ids=["fp8", "mxfp8"])
def test_pinning_and_moving_keep_the_tensor_quantized(make):
    q = make().quantize(torch.randn(64, 64))
    pinned = q.pin_memory()
    assert type(pinned) is type(q) and pinned.is_pinned() and not q.is_pinned()
    assert all(t is None or t.is_pinned() for t in pinned.get_data_tensors())
    moved = pinned.to(DEVICE, non_blocking=True)
    assert type(moved) is type(q) and moved.device.type == DEVICE
    assert torch.equal(moved.dequantize().cpu(), q.dequantize())
