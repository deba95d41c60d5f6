"""Offload composed with activation checkpointing and torch.compile."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bit_identical, forward, make_input, make_layers
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.device.runtime import available_device_type

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


def test_a_model_compiled_before_the_hooks_warns_that_nothing_was_offloaded():
    """A model compiled as a whole runs its layers in one graph, without the hooks (they
    add no graph break); the handle says so at the first backward.  Its layers compiled
    one by one are entered around their compiled calls, and offload (their saved
    intermediates, the tanh's output saved by the second linear: NOTE [Copies as graph
    ops])."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3))
    )
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 8)).sum().backward()
    handle = offload_layers(list(model), 2, min_offload_numel=0)
    with pytest.warns(UserWarning) as caught:
        compiled(torch.randn(4, 8)).sum().backward()
    messages = [str(w.message) for w in caught if "cpu_offload" in str(w.message)]
    assert len(messages) == 1
    assert "no forward since offload_layers() went through its hooks" in messages[0]
    assert "Compile the layers one by one instead (block.compile()" in messages[0]
    assert handle.offload_synchronizer.stats.forward_passes == 0
    for layer in model:  # the advice: the layers compiled one by one
        layer.compile(backend="aot_eager")
    handle.remove()
    handle = offload_layers(list(model), 2, min_offload_numel=0)
    model(torch.randn(4, 8)).sum().backward()
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    handle.remove()
    torch._dynamo.reset()
