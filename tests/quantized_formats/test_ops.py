"""The op table of ``QuantizedTensor`` and the rule for every other op: refused."""

from __future__ import annotations

import pytest
import torch

from quantized import Float8Quantizer, MXFP8Quantizer
from quantized.ops import QUANTIZED_OPS

QUANTIZERS = [
    pytest.param(Float8Quantizer(), id="fp8"),
    pytest.param(MXFP8Quantizer(torch.float8_e5m2, columnwise=True), id="mxfp8-col"),
]


def test_the_table_lists_the_handled_ops():
    assert sorted(str(op) for op in QUANTIZED_OPS) == [
        "aten._pin_memory.default",
        "aten._to_copy.default",
        "aten.alias.default",
        "aten.detach.default",
        "aten.is_pinned.default",
    ]


def test_the_table_is_read_only():
    with pytest.raises(TypeError):
        QUANTIZED_OPS[torch.ops.aten.add.Tensor] = lambda *a: None  # type: ignore[index]


# Ops that the dequantize fallback used to run on a full-precision copy.
OUTSIDE = {
    "add": ("aten::add.Tensor", lambda q: q + 1),
    "mul": ("aten::mul.Tensor", lambda q: q * 2),
    "matmul": ("aten::mm.default", lambda q: q @ torch.ones(64, 8)),
    "view": ("aten::view.default", lambda q: q.view(-1)),
    "empty_like": ("aten::empty_like.default", torch.empty_like),
    "equal": ("aten::equal.default", lambda q: torch.equal(q, q)),
}


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize("op", list(OUTSIDE))
def test_an_op_outside_the_table_raises_naming_the_op_and_the_fix(quantizer, op):
    q = quantizer.quantize(torch.randn(32, 64))
    name, call = OUTSIDE[op]
    with pytest.raises(NotImplementedError) as caught:
        call(q)
    message = str(caught.value)
    assert message.startswith(f"{type(q).__name__} does not support {name}: ")
    assert "the ops in quantized.ops.QUANTIZED_OPS" in message
    assert "call .dequantize() on it first" in message
    call(q.dequantize())  # the fix the message gives


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda x, q: x.add_(q), id="add_"),
        pytest.param(lambda x, q: x.copy_(q), id="copy_"),  # save_on_cpu(pin_memory=True)
    ],
)
def test_an_in_place_op_on_a_plain_tensor_that_reads_a_quantized_one_raises(quantizer, read):
    q = quantizer.quantize(torch.randn(32, 64))
    x = torch.zeros(32, 64)
    with pytest.raises(NotImplementedError, match="call .dequantize.. on it first") as caught:
        read(x, q)
    assert "would modify the quantized tensor in place" not in str(caught.value)
    assert torch.equal(x, torch.zeros(32, 64))
    read(x, q.dequantize())
    assert torch.equal(x, q.dequantize())


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_a_conversion_dequantizes_and_a_layout_change_is_refused(quantizer):
    q = quantizer.quantize(torch.randn(32, 64))
    assert torch.equal(q.to(torch.bfloat16), q.dequantize().bfloat16())
    assert torch.equal(q.double(), q.dequantize().double())
    moved = q.to("meta", torch.float64)
    assert type(moved) is torch.Tensor and moved.device.type == "meta"
    image = quantizer.quantize(torch.randn(2, 2, 8, 64))
    with pytest.raises(NotImplementedError, match="memory_format=torch.channels_last") as caught:
        image.to(memory_format=torch.channels_last)
    assert "move it (device, non_blocking, pin_memory) or convert its dtype" in str(caught.value)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_metadata_and_the_handled_ops_need_no_fallback(quantizer):
    q = quantizer.quantize(torch.randn(32, 64))
    assert (q.numel(), q.dim(), len(q), q.stride(), q.is_contiguous()) == (
        2048,
        2,
        32,
        (64, 1),
        True,
    )
    assert q.element_size() == 4 and q.device.type == "cpu" and q.requires_grad is False
    for same in (q.detach(), torch.ops.aten.alias(q)):
        assert type(same) is type(q)
        assert all(a is b for a, b in zip(same.get_data_tensors(), q.get_data_tensors()))
    assert q.is_pinned() is False
    assert type(q.to("meta")) is type(q)
