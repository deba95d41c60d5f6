"""Quantized activations under the offloader: components move, scales stay, exact."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bit_identical, forward

from cpu_offload import get_cpu_offload_context
from quantized import Float8Quantizer, Float8Tensor, MXFP8Quantizer, QuantizedLinear

pytestmark = pytest.mark.usefixtures("streams")

QUANTIZERS = {
    "fp8": lambda: Float8Quantizer(),
    "fp8-col": lambda: Float8Quantizer(torch.float8_e5m2, columnwise=True),
    "mxfp8": lambda: MXFP8Quantizer(),
    "mxfp8-col": lambda: MXFP8Quantizer(columnwise=True),
}
L, WIDTH, ROWS = 4, 64, 64


def tanh_after(layers):
    return [lambda x, layer=layer: torch.tanh(layer(x)) for layer in layers]


def make_stack(name: str) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        QuantizedLinear(WIDTH, WIDTH, quantizer=QUANTIZERS[name]()) for _ in range(L)
    )


def run(layers, offloaded, iterations=2, min_offload_numel=1024):
    ctx = sync_fn = None
    if offloaded:
        ctx, sync_fn = get_cpu_offload_context(
            True, offloaded, L, min_offload_numel=min_offload_numel
        )
    grads = []
    for step in range(iterations):
        layers.zero_grad(set_to_none=True)
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step))
        x.requires_grad_()
        forward(tanh_after(layers), x, ctx, sync_fn).square().mean().backward()
        grads.extend(p.grad.clone() for p in layers.parameters())
    return grads, ctx


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_gradients_bit_identical(name):
    layers = make_stack(name)
    expected, _ = run(layers, None)
    actual, ctx = run(layers, 2)
    assert_bit_identical(expected, actual)
    stats = ctx.offload_synchronizer.stats
    assert stats.tensors_offloaded > 0 and stats.tensors_reloaded == stats.tensors_offloaded


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_data_components_offloaded_scales_stay(name):
    layers = make_stack(name)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=1024)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with ctx:
        h = torch.tanh(layers[0](x))  # saves the quantized input of layer 0
    h = sync_fn(h)
    with ctx:
        out = layers[1](h)
    state = ctx.offload_synchronizer.layer_states[0]
    host = state._data.host
    fp8 = [b for b in host if b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    columnwise = name.endswith("-col")
    assert len(fp8) == (2 if columnwise else 1)  # data (and its column-wise copy)
    assert all(b.dtype != torch.uint8 for b in host)  # MX scales (64 x 2) stay
    assert not any(b.dim() == 0 for b in host)  # the per-tensor scale stays
    # h (tanh's output, saved by tanh) is the one plain tensor offloaded
    assert len(host) == len(fp8) + 1
    out.sum().backward()


def test_rebuilt_tensor_is_bit_identical():
    from cpu_offload.device.runtime import get_backend
    from cpu_offload.engine.layer_state import OffloadableLayerState
    from cpu_offload.hooks.handles import unpack_saved

    backend = get_backend("cpu")
    state = OffloadableLayerState(backend.new_stream(), backend=backend, min_offload_numel=0)
    q = MXFP8Quantizer(columnwise=True).quantize(torch.randn(64, 64))
    handle = state.push_tensor(q)
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    rebuilt = unpack_saved(handle)
    assert type(rebuilt) is type(q) and rebuilt is not q
    for a, b in zip(q.get_data_tensors(), rebuilt.get_data_tensors()):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert a.data_ptr() != b.data_ptr()


class _SaveTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer):
        q = quantizer.quantize(x)
        ctx.save_for_backward(q, q)  # two saved tensors sharing data and scale
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * (a.dequantize() + b.dequantize()), None


def test_shared_scale_is_copied_once():
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    x = torch.randn(16, 16, requires_grad=True)
    with ctx:
        y = _SaveTwice.apply(x, Float8Quantizer())
    y = sync_fn(y)
    with ctx:
        z = y.sum()
    state = ctx.offload_synchronizer.layer_states[0]
    assert state.num_offloaded_tensors == 2  # data and scale_inv, each once
    z.backward()
    q = Float8Quantizer().quantize(x.detach())
    assert torch.equal(x.grad, 2 * q.dequantize())  # grad * (a + b), grad = 1
    assert isinstance(q, Float8Tensor)


class _ComputesOnTheSavedValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer):
        ctx.save_for_backward(quantizer.quantize(x))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (q,) = ctx.saved_tensors
        return grad * q, None  # q is quantized: aten.mul is not in the op table


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_an_op_outside_the_table_fails_the_same_with_and_without_offload(name):
    layers = [lambda x: torch.tanh(_ComputesOnTheSavedValue.apply(x, QUANTIZERS[name]()))] * L
    messages = []
    for offloaded in (None, 2):
        ctx = sync_fn = None
        if offloaded:
            ctx, sync_fn = get_cpu_offload_context(True, offloaded, L, min_offload_numel=0)
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        out = forward(layers, x, ctx, sync_fn).sum()
        with pytest.raises(NotImplementedError, match=r"does not support aten::mul\.Tensor") as e:
            out.backward()
        messages.append(str(e.value))
    assert messages[0] == messages[1]
