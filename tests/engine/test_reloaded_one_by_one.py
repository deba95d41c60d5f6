"""A reloaded layer's tensors go one by one, as autograd's use of each ends (NOTE
[Reloaded tensors go one by one] in engine/layer_data.py), not at the layer's end."""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import modeled_device

from cpu_offload import LayerState, OffloadableLayerState, get_cpu_offload_context
from cpu_offload.device.runtime import get_backend
from cpu_offload.engine.host_buffers import HostBufferPool
from cpu_offload.testing import timed_runtime

MIB = 2**20
DEVICE = modeled_device()


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
        pop = OffloadableLayerState.pop_leased

        def keep(state, lease, index, prefetch=True):
            tensor = pop(state, lease, index, prefetch)
            state._data.reloaded[index] = tensor  # held again, until the layer's end
            return tensor

        monkeypatch.setattr(OffloadableLayerState, "pop_leased", keep)
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


# ---------------------------------------------- NOTE [Reloading a layer in slices]


def two_layers_of_sines(slice_bytes: int | None, on_demand: tuple[int, ...] = ()) -> tuple:
    """Two layers of four sines (1 MiB saved each) on the modeled accelerator, the first
    offloaded, reloaded whole or in slices of ``slice_bytes`` (on demand in the layers
    ``on_demand``)."""
    x = torch.empty(MIB // 4, device="meta", requires_grad=True)
    with timed_runtime(DEVICE) as run:
        marks: list = []
        ctx, sync_fn = get_cpu_offload_context(
            True,
            1,
            2,
            min_offload_numel=0,
            reload_slice_bytes=slice_bytes,
            reload_on_demand_layers=on_demand,
        )
        h = x * 1
        for _ in range(2):
            with ctx:
                h = chain_of_sines(h, marks, run)
            h = sync_fn(h)
        h.sum().backward()
    return run, marks, ctx.offload_synchronizer.stats


def test_a_layer_reloaded_in_slices_peaks_lower_than_a_whole_reload():
    """Whole, layer 0's four reloaded tensors (1 MiB each) arrive together before its
    backward; in slices of one tensor, one arrives then and each next one as the one
    before it starts being consumed: as backward reaches each of its sines, layer 0
    holds two tensors at most (the one in use, the next), not all four left, and the
    step's peak is lower; the same bytes move."""
    whole, whole_marks, _ = two_layers_of_sines(None)
    sliced, sliced_marks, stats = two_layers_of_sines(MIB)
    assert sliced.h2d_bytes == whole.h2d_bytes == 4 * MIB
    assert stats.tensors_reloaded == 4 and stats.slices_on_demand == 0
    kept = [m.counted for _, m in whole_marks[:4]]  # layer 1's: the same in both
    assert kept == [m.counted for _, m in sliced_marks[:4]]
    layer0 = [m.counted - kept[-1] for _, m in whole_marks[4:]]
    assert layer0 == [3 * MIB, 2 * MIB, MIB, 0]  # all that is left, reloaded together
    layer0 = [m.counted - kept[-1] for _, m in sliced_marks[4:]]
    assert layer0 == [MIB, MIB, MIB, 0]  # the next slice only
    assert whole.peak_bytes - sliced.peak_bytes == MIB


def test_a_layer_reloaded_on_demand_holds_no_prefetched_slice():
    """NOTE [Slices at the peak]: with layer 0 on demand, each of its slices after the
    first is issued by its own pop, not by the pop before it: as backward reaches each
    sine's backward, layer 0 holds nothing before the sine pops its tensor (with the
    prefetch, that tensor is there already), the same bytes move, and the copies it
    waits for are exposed."""
    prefetched, prefetched_marks, _ = two_layers_of_sines(MIB)
    on_demand, marks, stats = two_layers_of_sines(MIB, on_demand=(0,))
    assert on_demand.h2d_bytes == prefetched.h2d_bytes == 4 * MIB
    assert stats.tensors_reloaded == 4 and stats.slices_on_demand == 3
    kept = [m.counted for _, m in marks[:4]][-1]
    assert [m.counted - kept for _, m in marks[4:]] == [0, 0, 0, 0]  # issued by the pop
    held = [m.counted - kept for _, m in prefetched_marks[4:]]
    assert held == [MIB, MIB, MIB, 0]  # the next slice, prefetched
    assert on_demand.exposed_copy_s > prefetched.exposed_copy_s


def test_reload_on_demand_layers_is_checked():
    with pytest.raises(ValueError, match="needs reload_slice_bytes"):
        get_cpu_offload_context(True, 1, 2, reload_on_demand_layers=[0])
    with pytest.raises(ValueError, match=r"layer indices in \[0, 2\), got 2"):
        get_cpu_offload_context(True, 1, 2, reload_slice_bytes=1, reload_on_demand_layers=[2])
    with pytest.raises(TypeError, match="a sequence of layer indices, got int 0"):
        get_cpu_offload_context(True, 1, 2, reload_slice_bytes=1, reload_on_demand_layers=0)


def test_a_tensor_unpacked_before_its_slice_gets_its_slice_at_once():
    """A pop from a slice not issued yet (a node unpacking in pack order) issues that
    slice on demand and is handed the right tensor; the slice after it is prefetched."""
    state = make_state()
    state.reload_slice_bytes = 1  # one tensor per slice
    xs = [torch.randn(16) for _ in range(4)]
    handles = [state.push_tensor(x) for x in xs]
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    assert state.slices is not None and state.slices.issued == [True, False, False, False]
    assert torch.equal(state.pop_tensor(handles[0]), xs[0])  # the last slice, out of order
    assert state.stats.slices_on_demand == 1
    assert torch.equal(state.pop_tensor(handles[3]), xs[3])  # slice 0, in order
    assert state.slices.issued == [True, True, False, True]  # slice 1 prefetched
    assert torch.equal(state.pop_tensor(handles[2]), xs[2])
    assert torch.equal(state.pop_tensor(handles[1]), xs[1])
    assert state.stats.slices_on_demand == 1 and state.stats.tensors_reloaded == 4
    state.release_all_memory()


def test_slices_take_tensors_in_reverse_pack_order():
    from cpu_offload.engine.reload_slices import slice_sources

    assert slice_sources([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert slice_sources([1, 8, 1, 1], 2) == [[3, 2], [1], [0]]
    assert slice_sources([5], 100) == [[0]]


@pytest.mark.parametrize(
    "value, error, message",
    [
        (
            64.0,
            TypeError,
            "reload_slice_bytes must be None (reload each offloaded layer whole), an int "
            "of bytes >= 1 or a size such as '64MiB', got float 64.0",
        ),
        ("64 apples", ValueError, "reload_slice_bytes='64 apples' is not a size"),
        (True, TypeError, "got bool True"),
        (
            0,
            ValueError,
            "reload_slice_bytes must be >= 1 (bytes per slice of a reloaded "
            "layer), got 0; pass None to reload each offloaded layer whole",
        ),
    ],
)
def test_reload_slice_bytes_is_checked(value, error, message):
    with pytest.raises(error) as raised:
        get_cpu_offload_context(True, 1, 2, reload_slice_bytes=value)
    assert message in str(raised.value)
    assert str(raised.value).startswith("get_cpu_offload_context: ")
    from cpu_offload import offload_layers

    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    with pytest.raises(error, match="reload_slice_bytes"):
        offload_layers(layers, 1, reload_slice_bytes=value)


def test_reload_slice_bytes_does_not_combine_with_a_memory_budget_yet():
    from cpu_offload import offload_layers

    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    with pytest.raises(TypeError) as raised:
        offload_layers(layers, memory_budget="1GiB", reload_slice_bytes=64 * MIB)
    assert "reload_slice_bytes= does not combine with it" in str(raised.value)


@pytest.mark.usefixtures("streams")
def test_a_step_report_counts_the_slices_copied_back_not_the_whole_layer():
    """A backward that unpacks only the tensors of a layer's last slice (``inputs=[w]``:
    the nodes before the last multiply do not run) copies back that slice and the one
    prefetched after it: the step report's ``reloaded_bytes`` says what was copied
    back, as ``stats.bytes_reloaded`` does, not the layer's whole host copy."""
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0, reload_slice_bytes=1)
    synchronizer = ctx.offload_synchronizer
    stats = synchronizer.stats

    def step() -> None:
        h = torch.randn(16, 64, requires_grad=True)
        for _ in range(3):
            with ctx:
                h = h.sin().cos().exp() * w  # saves h, sin, cos, exp (4 KiB each) and w
            h = sync_fn(h)
        h.sum().backward(inputs=[w])

    step()
    before = (stats.bytes_offloaded, stats.bytes_reloaded)
    step()
    copied, reloaded = stats.bytes_offloaded - before[0], stats.bytes_reloaded - before[1]
    figures = synchronizer.report().to_dict()
    assert figures["copied_bytes"] == copied > reloaded > 0
    assert figures["reloaded_bytes"] == reloaded
