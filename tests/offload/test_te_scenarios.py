"""TransformerEngine's offloading scenarios that need no TE layer, against our classes.

Code written against TE's classes constructs them as ``OffloadableLayerState(
offload_stream=stream)`` and ``DefaultOffloadSynchronizer(num_layers=...,
num_offloaded_layers=...)`` and drives them by hand; it must run unchanged.
"""

from __future__ import annotations

import pytest
import torch

from cpu_offload import (
    DefaultOffloadSynchronizer,
    LayerState,
    ManualOffloadSynchronizer,
    OffloadableLayerState,
    start_offload,
)
from cpu_offload.device.runtime import get_backend

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

BIG = (512, 1024)  # above the default threshold of 256 Ki elements


def test_a_layer_state_used_alone():
    state = OffloadableLayerState(offload_stream=get_backend().new_stream())
    tensors = [torch.randn(BIG), torch.randn(BIG, dtype=torch.bfloat16), torch.randn(8)]
    handles = [state.push_tensor(t) for t in tensors]
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    assert state.state is LayerState.OFFLOAD_FINISHED
    assert state.num_offloaded_tensors == 2  # the small one stays
    state.start_reload()
    popped = [state.pop_tensor(h) for h in handles]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, popped))
    assert popped[0] is not tensors[0] and popped[2] is tensors[2]
    del handles  # what autograd does when the graph goes
    state.release_all_memory()
    assert state.state is LayerState.NOT_OFFLOADED


def test_default_synchronizer_driven_by_hand():
    layers, offloaded = 4, 2
    synchronizer = DefaultOffloadSynchronizer(num_layers=layers, num_offloaded_layers=offloaded)
    saved = [torch.randn(BIG) for _ in range(layers)]
    handles = []
    for layer in range(layers):
        assert synchronizer.fwd_step() == layer
        handles.append(synchronizer.push_tensor(saved[layer]))
    for layer in reversed(range(layers)):
        synchronizer.bwd_step(layer)
        assert torch.equal(synchronizer.pop_tensor(handles[layer]), saved[layer])
    synchronizer.finish_part_of_bwd()
    stats = synchronizer.stats
    assert stats.tensors_offloaded == stats.tensors_reloaded == offloaded
    assert stats.on_demand_reloads == 0


def test_a_tensor_pushed_three_times_is_copied_once():
    state = OffloadableLayerState(offload_stream=get_backend().new_stream())
    tensor = torch.randn(BIG)
    handles = [state.push_tensor(tensor) for _ in range(3)]
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    popped = [state.pop_tensor(h) for h in handles]
    assert state.num_offloaded_tensors == 1
    assert popped[0] is popped[1] is popped[2] and torch.equal(popped[0], tensor)


def test_views_offloaded_through_their_base():
    state = OffloadableLayerState(offload_stream=get_backend().new_stream())
    qkv = torch.randn(4, 256, 3 * 512)
    q, k, v = (t.view(4, 256, 8, 64).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    start_offload(q, k, v, offload_base_tensor=True)
    handles = [state.push_tensor(t) for t in (q, k, v)]
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    popped = [state.pop_tensor(h) for h in handles]
    assert state.num_offloaded_tensors == 1  # the base, once
    for before, after in zip((q, k, v), popped):
        assert torch.equal(before, after) and before.stride() == after.stride()


def test_the_manual_controller():
    layers = 3
    synchronizer = ManualOffloadSynchronizer(num_layers=layers)
    saved = [torch.randn(BIG) for _ in range(layers)]
    handles = []
    for layer in range(layers):
        synchronizer.fwd_step()
        handles.append(synchronizer.push_tensor(saved[layer]))
        synchronizer.start_offload_layer(layer)
    for layer in range(layers):
        synchronizer.release_activation_forward_gpu_memory(layer)
    for layer in reversed(range(layers)):
        synchronizer.start_reload_layer(layer)
        synchronizer.bwd_step(layer)
        assert torch.equal(synchronizer.pop_tensor(handles[layer]), saved[layer])
    synchronizer.finish_part_of_bwd()
    assert synchronizer.stats.tensors_reloaded == layers


def test_tensors_pushed_by_hand_are_held_until_released_with_handles_thrown_away():
    """TransformerEngine's test_multiple_tensor_offload: the handles are not kept."""
    synchronizer = DefaultOffloadSynchronizer(num_layers=2, num_offloaded_layers=1)
    x = torch.randn(BIG)
    nbytes = x.numel() * x.element_size()
    synchronizer.fwd_step()
    for _ in range(3):
        synchronizer.push_tensor(x)
    synchronizer.fwd_step()  # starts layer 0's offload: x once
    assert synchronizer.stats.tensors_offloaded == 1
    assert synchronizer.stats.bytes_offloaded == nbytes
    assert synchronizer.get_offloaded_total_size_mb() == nbytes / 2**20
    synchronizer.bwd_step(1)
    synchronizer.bwd_step(0)
    synchronizer.finish_part_of_bwd()  # layer 0 released: its host copy goes
    assert synchronizer.host_memory_stats()["in_use_bytes"] == 0


def test_a_view_pushed_by_hand_moves_through_its_base():
    synchronizer = DefaultOffloadSynchronizer(num_layers=2, num_offloaded_layers=1)
    x = torch.randn(2 * BIG[0], BIG[1])
    halves = (x[::2], x[1::2])
    synchronizer.fwd_step()
    handles = [synchronizer.push_tensor(h, offload_base_tensor=True) for h in halves]
    synchronizer.fwd_step()
    assert synchronizer.stats.bytes_offloaded == x.numel() * x.element_size()  # the base, once
    synchronizer.bwd_step(1)
    synchronizer.bwd_step(0)
    popped = [synchronizer.pop_tensor(h) for h in handles]
    assert all(torch.equal(a, b) for a, b in zip(popped, halves))
    synchronizer.finish_part_of_bwd()
