"""A backward in two phases, as zero-bubble schedules (ZB-V) run it: input gradients (I),
then later weight gradients (W), whose reloads are prefetched (NOTE [A backward in two
phases] in engine/weight_pass.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import SPLIT_ORDERS, assert_bit_identical, forward, make_input, make_layers
from helpers import run_pipeline_order as run_order
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from cpu_offload import LayerState, get_cpu_offload_context
from cpu_offload.engine.layer_state import OffloadableLayerState


@pytest.fixture
def second_backward_on_demand(monkeypatch):
    """The names of the layers a second backward (W) reloaded on demand, unprefetched."""
    found: list[str] = []
    original = OffloadableLayerState._reload_on_demand

    def counting(self):
        if self.backward_done:
            found.append(self.name)
        return original(self)

    monkeypatch.setattr(OffloadableLayerState, "_reload_on_demand", counting)
    return found


@pytest.mark.usefixtures("streams")
@pytest.mark.parametrize("name", list(SPLIT_ORDERS))
@pytest.mark.parametrize(
    ("k", "keep_passes"), [(1, None), (3, None), (1, 1)], ids=["k1", "k3", "keep1-k1"]
)
def test_split_backward_bit_identical_and_prefetched(
    name, k, keep_passes, second_backward_on_demand
):
    layers = make_layers("mlp", 4, 32, torch.float32)
    expected, _ = run_order(layers, SPLIT_ORDERS[name], None)
    options = {} if keep_passes is None else {"keep_passes": keep_passes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k = L - 1; a moved pass reloaded on demand in I
        actual, ctx = run_order(layers, SPLIT_ORDERS[name], k, **options)
    assert_bit_identical(expected, actual)
    synchronizer = ctx.offload_synchronizer
    stats = synchronizer.stats
    assert stats.tensors_offloaded > 0
    # every offloaded tensor came back twice: for I, and for W
    assert stats.tensors_reloaded == 2 * stats.tensors_offloaded
    assert second_backward_on_demand == []  # W's reloads were all prefetched
    assert synchronizer.get_offloaded_total_size_mb() == 0
    assert synchronizer.in_flight_passes() == []
    assert synchronizer.host_memory_stats()["in_use_bytes"] == 0


def test_weight_pass_reloads_one_layer_ahead():
    """After I, one offloaded layer (W's first) is on its way back and the others wait on
    the host; W's first unpack of a layer releases the one before and reloads the next."""
    layers = make_layers("mlp", 4, 32, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx, sync_fn = get_cpu_offload_context(True, 3, 4, min_offload_numel=0)
    x = make_input("mlp", 32, torch.float32, 0).requires_grad_()
    out = forward(layers, x, ctx, sync_fn)
    forward_pass = ctx.offload_synchronizer.in_flight_passes()[-1]
    _, groups = stage_backward_input([out.square().mean()], None, [x], layers.parameters())
    states = [forward_pass.state(layer).state for layer in range(3)]
    assert states == [
        LayerState.RELOAD_STARTED,
        LayerState.OFFLOAD_FINISHED,
        LayerState.OFFLOAD_FINISHED,
    ]
    seen = []
    assert len(groups) == 8  # one per linear layer, in the order of parameters()
    for group in groups:  # W, a group at a time: layer 0's two, then layer 1's, ...
        stage_backward_weight(layers.parameters(), [group])
        seen.append([forward_pass.state(layer).state for layer in range(3)])
    # after layer 0's first group (its up projection): layer 1 reloading, 2 on the host
    assert seen[0][1:] == [LayerState.RELOAD_STARTED, LayerState.OFFLOAD_FINISHED]
    # after layer 1's: layer 0 released (host copy kept), 2 reloading
    assert seen[2] == [
        LayerState.OFFLOAD_FINISHED,
        LayerState.RELOAD_STARTED,
        LayerState.RELOAD_STARTED,
    ]
