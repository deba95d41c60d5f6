"""The saving protocol and tensor-subclass semantics."""

from __future__ import annotations

import pytest
import torch

from quantized import (
    Float8Quantizer,
    Float8Tensor,
    MXFP8Quantizer,
    MXFP8Tensor,
    QuantizedTensor,
    prepare_for_saving,
    restore_from_saved,
)

QUANTIZERS = [
    pytest.param(Float8Quantizer(), id="fp8-e4m3"),
    pytest.param(Float8Quantizer(torch.float8_e5m2, columnwise=True), id="fp8-e5m2-col"),
    pytest.param(MXFP8Quantizer(), id="mxfp8"),
    pytest.param(MXFP8Quantizer(torch.float8_e5m2, columnwise=True), id="mxfp8-e5m2-col"),
]


def bits(t: torch.Tensor | None):
    return None if t is None else t.reshape(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_prepare_and_restore_round_trip_is_bit_exact(quantizer):
    q = quantizer.quantize(torch.randn(64, 64, dtype=torch.bfloat16))
    before = [bits(t) for t in q.get_data_tensors()]
    expected = q.dequantize()
    components, obj = q.prepare_for_saving()
    assert obj is q and all(t is None for t in q.get_data_tensors())
    with pytest.raises(RuntimeError, match="handed over by prepare_for_saving"):
        q.dequantize()
    copies = [None if t is None else t.clone() for t in components]
    assert q.restore_from_saved(copies + ["rest"]) == ["rest"]
    after = [bits(t) for t in q.get_data_tensors()]
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(q.dequantize(), expected)


def test_module_functions_pass_plain_tensors_through():
    plain = torch.randn(3)
    q = Float8Quantizer().quantize(torch.randn(4, 4))
    flat, objects = prepare_for_saving(plain, q, None)
    assert flat[0] is plain and len(flat) == 1 + 3 + 1 and objects[0] is None
    restored = restore_from_saved(objects, flat)
    assert restored[0] is plain and restored[1] is q and restored[2] is None
    with pytest.raises(ValueError, match="expected at least 3 tensors"):
        Float8Quantizer().quantize(torch.randn(2, 2)).restore_from_saved([None])


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_tensor_semantics(quantizer):
    x = torch.randn(32, 64)
    q = quantizer.quantize(x)
    assert isinstance(q, QuantizedTensor) and q.shape == x.shape and q.dtype == x.dtype
    detached = q.detach()
    assert type(detached) is type(q) and detached is not q
    assert all(a is b for a, b in zip(q.get_data_tensors(), detached.get_data_tensors()))
    names, ctx = q.__tensor_flatten__()
    inner = {name: getattr(q, name) for name in names}
    rebuilt = type(q).__tensor_unflatten__(inner, ctx, q.shape, q.stride())
    assert torch.equal(rebuilt.dequantize(), q.dequantize())
    assert "shape=(32, 64)" in repr(q)


IN_PLACE = {
    "add_": lambda q: q.add_(100),
    "zero_": lambda q: q.zero_(),
    "copy_": lambda q: q.copy_(torch.zeros(q.shape)),
    "out=": lambda q: torch.add(torch.ones(q.shape), 1, out=q),
}


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize("op", list(IN_PLACE))
def test_in_place_ops_on_a_quantized_tensor_raise(quantizer, op):
    q = quantizer.quantize(torch.randn(32, 64))
    before = q.dequantize()
    with pytest.raises(NotImplementedError, match="would modify the quantized tensor in place"):
        IN_PLACE[op](q)
    assert torch.equal(q.dequantize(), before)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_moving_keeps_the_tensor_quantized_and_converting_dequantizes(quantizer):
    q = quantizer.quantize(torch.randn(32, 64))
    moved = q.to("meta")
    assert type(moved) is type(q) and moved.device.type == "meta"
    assert all(t is None or t.device.type == "meta" for t in moved.get_data_tensors())
    copied = q.to("cpu", copy=True)
    assert type(copied) is type(q)
    assert all(
        a is None or (torch.equal(bits(a), bits(b)) and a is not b)
        for a, b in zip(copied.get_data_tensors(), q.get_data_tensors())
    )
    assert q.is_pinned() is False
    converted = q.to(torch.float64)
    assert type(converted) is torch.Tensor and torch.equal(converted, q.dequantize().double())


def test_fields_are_derived_from_the_class_annotations():
    assert Float8Tensor.component_names == ("_data", "_transpose", "_scale_inv")
    assert Float8Tensor.attribute_names == ("fp8_dtype",)
    assert MXFP8Tensor.attribute_names == ("fp8_dtype", "block_size")
    q = MXFP8Quantizer().quantize(torch.randn(4, 64))
    assert q.block_size == 32 and q.fp8_dtype == torch.float8_e4m3fn


def test_the_constructor_names_unknown_and_missing_fields():
    data = torch.zeros(4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"unknown fields \['meta'\], missing \['fp8_dtype'\]"):
        Float8Tensor(shape=data.shape, dtype=torch.float32, meta={}, _data=data)
