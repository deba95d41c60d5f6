"""Gradients with offload are bit-identical to gradients without it."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bit_identical, gradients, make_layers

from cpu_offload.device.runtime import StreamBackend, get_backend

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offloaded", [1, 2], ids=["k1", "k2"])
def test_gradients_bit_identical(streams, kind, dtype, offloaded):
    layers = make_layers(kind, 4, 32, dtype)
    expected = gradients(layers, kind, 32, dtype, offloaded=None)
    actual = gradients(layers, kind, 32, dtype, offloaded=offloaded)
    assert_bit_identical(expected, actual)
    if streams is not None:
        assert streams.counters.copies_run > 0
        # StreamBackend, as on a device, reports no handoffs: compute checks them.
        assert streams.counters.handoffs > 0 or isinstance(get_backend(), StreamBackend)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_gradient_accumulation_two_micro_batches(streams, kind):
    layers = make_layers(kind, 4, 32, torch.float32)
    expected = gradients(layers, kind, 32, torch.float32, offloaded=None, micro_batches=2)
    actual = gradients(layers, kind, 32, torch.float32, offloaded=2, micro_batches=2)
    assert_bit_identical(expected, actual)


def test_all_but_last_layer_offloaded(streams, quiet):
    layers = make_layers("mlp", 3, 32, torch.float32)
    expected = gradients(layers, "mlp", 32, torch.float32, offloaded=None)
    actual = gradients(layers, "mlp", 32, torch.float32, offloaded=2)
    assert_bit_identical(expected, actual)


def test_threshold_keeps_everything_on_device(streams):
    layers = make_layers("mlp", 4, 32, torch.float32)
    expected = gradients(layers, "mlp", 32, torch.float32, offloaded=None)
    actual = gradients(layers, "mlp", 32, torch.float32, offloaded=2, min_offload_numel=10**9)
    assert_bit_identical(expected, actual)
    if streams is not None:
        assert streams.counters.copies_queued == 0
