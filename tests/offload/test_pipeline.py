"""Several forward passes in flight: emulated pipeline orders, single process."""

from __future__ import annotations

import pytest
import torch
from helpers import PIPELINE_ORDERS as ORDERS
from helpers import assert_bit_identical, forward, make_input, make_layers, run_pipeline_order

from cpu_offload import CpuOffloadError, LayerState, get_cpu_offload_context

pytestmark = pytest.mark.usefixtures("streams")


def run_order(layers, order: str, offloaded: int | None) -> list[torch.Tensor]:
    grads, ctx = run_pipeline_order(layers, order, offloaded)
    if ctx is not None:
        assert ctx.offload_synchronizer.get_offloaded_total_size_mb() == 0
        assert ctx.offload_synchronizer.stats.on_demand_reloads == 0
    return grads


@pytest.mark.parametrize("name", list(ORDERS))
@pytest.mark.parametrize("offloaded", [1, 3], ids=["k1", "k3"])
def test_pipeline_orders_bit_identical(name, offloaded):
    layers = make_layers("mlp", 4, 32, torch.float32)
    expected = run_order(layers, ORDERS[name], None)
    actual = run_order(layers, ORDERS[name], offloaded)
    assert_bit_identical(expected, actual)


def test_passes_in_flight_each_own_their_layers():
    layers = make_layers("mlp", 4, 32, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    outs = [
        forward(layers, make_input("mlp", 32, torch.float32, s).requires_grad_(), ctx, sync_fn)
        for s in range(3)
    ]
    passes = ctx.offload_synchronizer.in_flight_passes()
    assert len(passes) == 3 and len({p.index for p in passes}) == 3
    assert all(p.layer_states[0].state is LayerState.OFFLOAD_FINISHED for p in passes)
    outs[1].sum().backward()  # B1 first: the others are untouched
    assert passes[0].layer_states[0].state is LayerState.OFFLOAD_FINISHED
    assert passes[1].layer_states[0].state is LayerState.NOT_OFFLOADED
    outs[0].sum().backward()
    outs[2].sum().backward()


def test_manual_controller_addresses_passes():
    layers = make_layers("mlp", 3, 32, torch.float32)
    inputs = [make_input("mlp", 32, torch.float32, s).requires_grad_() for s in range(2)]
    for x in inputs:
        forward(layers, x).square().mean().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=3, manual_synchronization=True, min_offload_numel=0
    )
    outs, passes = [], []
    for x in inputs:  # F0 F1, offloading layers 0 and 1 of each pass
        h = x
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h)
            h = sync_fn(h)
            if i >= 1:
                controller.start_offload_layer(i - 1)  # the latest pass: this one
        passes.append(controller.in_flight_passes()[-1])
        outs.append(h)
    for forward_pass in passes:
        for i in range(2):
            controller.release_activation_forward_gpu_memory(i, forward_pass=forward_pass)
    for number, out in enumerate(outs):  # B0 B1, reloading the addressed pass by index
        for i in reversed(range(2)):
            controller.start_reload_layer(i, forward_pass=passes[number].index)
        out.square().mean().backward()
    assert_bit_identical(expected, [p.grad.clone() for p in layers.parameters()])
    del passes, outs, out, h, forward_pass  # the graphs die, and their passes with them
    with pytest.raises(CpuOffloadError, match="no forward pass in flight"):
        controller.start_reload_layer(0)
