"""Quantization numerics against the numpy reference of fp8_reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8_reference import float8_reference, max_finite, mx_reference

from quantized import Float8Quantizer, MXFP8Quantizer

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def sample(seed: int) -> torch.Tensor:
    """Normal values over many magnitudes, with zeros and values near denormals."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=generator)
    x = x * torch.exp2(torch.randint(-20, 8, (8, 64), generator=generator).float())
    x[0, :5] = 0.0
    return x


def same(actual: torch.Tensor, expected: np.ndarray) -> bool:
    return np.array_equal(actual.float().numpy(), expected.astype(np.float32), equal_nan=True)


def test_reference_grid_matches_torch_max():
    assert max_finite("e4m3fn") == torch.finfo(torch.float8_e4m3fn).max == 448
    assert max_finite("e5m2") == torch.finfo(torch.float8_e5m2).max == 57344


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float8_matches_reference(name, seed):
    x = sample(seed)
    q = Float8Quantizer(FP8[name]).quantize(x)
    data, scale_inv = float8_reference(x.numpy(), name)
    assert same(q._data, data)
    assert q._scale_inv.item() == scale_inv
    assert torch.equal(q.dequantize(), (q._data.float() * q._scale_inv).to(x.dtype))


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp8_matches_reference(name, seed):
    x = sample(seed)
    q = MXFP8Quantizer(FP8[name]).quantize(x)
    data, scales = mx_reference(x.numpy(), name, 32)
    assert same(q._rowwise_data, data)
    assert np.array_equal(q._rowwise_scale_inv.numpy(), scales)


def test_round_to_nearest_even_and_saturation():
    # amax 448 gives scale 1 (Float8) and shared exponent 0 (MX, E4M3): values pass as is.
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 0.001953125] + [0.0] * 27])
    for q in (Float8Quantizer().quantize(x), MXFP8Quantizer().quantize(x)):
        values = q.get_data_tensors()[0].float()[0, :5].tolist()
        assert values == [448.0, 1.0, 1.25, -1.0, 0.001953125]  # ties to even; a denormal


def test_infinities_saturate_and_nan_stays():
    x = torch.tensor([[1.0, -2.0, float("inf"), float("-inf"), float("nan")] + [0.5] * 27])
    q = Float8Quantizer().quantize(x)
    assert q._scale_inv.item() == pytest.approx(2.0 / 448)  # amax over finite values
    data = q._data.float()[0]
    assert data[2] == 448 and data[3] == -448 and torch.isnan(data[4])
    mx = MXFP8Quantizer().quantize(x)._rowwise_data.float()[0]
    assert mx[2] == 448 and mx[3] == -448 and torch.isnan(mx[4])


def test_zeros():
    x = torch.zeros(2, 32)
    q = Float8Quantizer().quantize(x)
    assert q._scale_inv.item() == 1.0 and torch.equal(q.dequantize(), x)
    mx = MXFP8Quantizer().quantize(x)
    assert torch.all(mx._rowwise_scale_inv == 0) and torch.equal(mx.dequantize(), x)


def test_columnwise_copies():
    x = sample(3)
    q = Float8Quantizer(columnwise=True).quantize(x)
    assert torch.equal(q._transpose, q._data.t())
    x = torch.randn(64, 64)
    mx = MXFP8Quantizer(columnwise=True).quantize(x)
    data, scales = mx_reference(x.t().contiguous().numpy(), "e4m3fn", 32)
    assert same(mx._columnwise_data, data)
    assert np.array_equal(mx._columnwise_scale_inv.numpy(), scales)


def test_uneven_blocks_are_an_error():
    with pytest.raises(
        ValueError, match=r"last dimension \(40\) must be a multiple of block_size=32"
    ):
        MXFP8Quantizer().quantize(torch.randn(4, 40))
    with pytest.raises(ValueError, match=r"leading dimensions \(4 rows\) must be a multiple"):
        MXFP8Quantizer(columnwise=True).quantize(torch.randn(4, 32))


def test_bad_arguments():
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        Float8Quantizer(torch.float16)
    with pytest.raises(TypeError, match="expected a floating tensor, got torch.int64"):
        MXFP8Quantizer().quantize(torch.ones(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        MXFP8Quantizer(block_size=0)
