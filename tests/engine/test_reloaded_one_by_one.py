"""A reloaded layer's tensors go one by one, as autograd's use of each ends (NOTE
[Reloaded tensors go one by one] in engine/layer_data.py), not at the layer's end."""

from __future__ import annotations

import weakref

import pytest
import torch

from cpu_offload import LayerState, OffloadableLayerState, get_cpu_offload_context
from cpu_offload.device.profiles import DeviceProfile
from cpu_offload.device.runtime import get_backend
from cpu_offload.engine.host_buffers import HostBufferPool
from cpu_offload.testing import timed_runtime

MIB = 2**20
DEVICE = DeviceProfile(
    link_bytes_per_s=1e9,
    flops_per_s=1e12,
    memory_bytes_per_s=1e11,
    launch_s=1e-6,
    host_issue_s=2e-6,
    name="test device",
)


def make_state() -> OffloadableLayerState:
    backend = get_backend("cpu")
    return OffloadableLayerState(
        backend.new_stream(),
        backend=backend,
        host_buffers=HostBufferPool(backend, False),
        min_offload_numel=0,
    )


@pytest.mark.usefixtures("streams")
def test_a_pop_lets_go_and_a_second_pop_copies_from_the_host_again():
    state = make_state()
    x = torch.randn(64, 8)
    first, second = state.push_tensor(x), state.push_tensor(x)  # saved by two nodes
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    a = state.pop_tensor(first)
    held = weakref.ref(a)
    del a
    assert held() is not None  # the other save still holds it
    b = state.pop_tensor(second)
    assert b is held()
    del b
    assert held() is None  # the layer holds nothing of it now
    reloads = state.stats.tensors_reloaded
    again = state.pop_tensor(first)  # a node unpacking twice
    assert torch.equal(again, x)
    assert state.stats.tensors_reloaded == reloads + 1
    state.release_all_memory()
    assert state.state is LayerState.OFFLOAD_FINISHED  # the handles live: host copies stay


def chain_of_sines(h: torch.Tensor, marks: list, run, n: int = 4) -> torch.Tensor:
    """``n`` sines, each saving its input; a mark of device memory as backward's
    gradient reaches each input (once the node that used it is done)."""
    for i in range(n):
        if h.requires_grad:
            h.register_hook(lambda g, i=i: marks.append((i, run.mark(f"grad {i}", [g]))))
        h = h.sin()
    return h


@pytest.mark.parametrize("per_tensor", [True, False], ids=["one by one", "at the layer's end"])
def test_device_memory_falls_within_an_offloaded_layers_backward(per_tensor, monkeypatch):
    """Two layers of four sines on the modeled accelerator, the first offloaded: in its
    backward, device memory falls by one saved tensor (1 MiB) per node that ran, as in
    the kept layer's; a layer that lets go only at its end (as before) holds them all
    until then."""
    if not per_tensor:  # what the layer did before: keep every reloaded tensor
        from cpu_offload.engine import layer_state

        keep = lambda data, layer, position: data.reloaded[position]  # noqa: E731
        monkeypatch.setattr(layer_state, "hand_out", keep)
    x = torch.empty(MIB // 4, device="meta", requires_grad=True)
    with timed_runtime(DEVICE) as run:
        marks: list = []
        ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
        h = x * 1  # the stack's input, on the device
        for _ in range(2):
            with ctx:
                h = chain_of_sines(h, marks, run)
            h = sync_fn(h)
        h.sum().backward()
    assert run.d2h_bytes == run.h2d_bytes == 4 * MIB  # layer 0's four saved tensors moved
    kept = [mark.counted for _, mark in marks[:4]]  # layer 1's hooks, in backward order
    layer0 = [mark.counted for _, mark in marks[4:]]  # layer 0's
    steps = [before - after for before, after in zip(layer0, layer0[1:])]
    if per_tensor:  # the offloaded layer's backward holds what the kept layer's does
        assert steps == [MIB, MIB, MIB] and layer0 == kept
    else:  # all four reloaded tensors until the layer's end
        assert steps == [0, 0, 4 * MIB] and layer0[0] == kept[0] + MIB
