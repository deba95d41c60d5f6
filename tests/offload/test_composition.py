"""Offload composed with activation checkpointing and torch.compile."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bit_identical, forward, make_input, make_layers
from torch.utils.checkpoint import checkpoint

from cpu_offload import get_cpu_offload_context
from cpu_offload.device import available_device_type

L, K = 4, 2


def run(fns, layers, ctx=None, sync_fn=None, device="cpu"):
    layers.zero_grad(set_to_none=True)
    x = make_input("mlp", 32, torch.float32, 0).to(device).requires_grad_()
    forward(fns, x, ctx, sync_fn).square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()]


def check(fns, layers, device="cpu"):
    expected = run(fns, layers, device=device)
    ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, device=device)
    for _ in range(2):
        assert_bit_identical(expected, run(fns, layers, ctx, sync_fn, device))
    return ctx.offload_synchronizer.stats


@pytest.mark.usefixtures("streams")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_layers_offload_their_inputs(reentrant):
    """Inside a checkpointed layer nothing is saved but the layer's input (it is
    recomputed in backward); that input is what gets offloaded, one per layer."""
    layers = make_layers("mlp", L, 32, torch.float32)
    fns = [lambda x, layer=layer: checkpoint(layer, x, use_reentrant=reentrant) for layer in layers]
    stats = check(fns, layers)
    assert stats.tensors_offloaded == 2 * K  # two iterations, K layers, one input each


def test_compiled_layers_aot_eager():
    """The compiled graph's saved tensors go through the hooks like eager ones."""
    layers = make_layers("mlp", L, 32, torch.float32)
    fns = [torch.compile(layer, backend="aot_eager") for layer in layers]
    stats = check(fns, layers)
    assert stats.tensors_offloaded == 2 * K * 3  # an MLP block saves three tensors


@pytest.mark.gpu
def test_compiled_layers_inductor_on_the_accelerator():
    device = available_device_type()
    layers = make_layers("mlp", L, 32, torch.float32).to(device)
    fns = [torch.compile(layer, backend="inductor") for layer in layers]
    stats = check(fns, layers, device=device)
    assert stats.tensors_offloaded > 0
