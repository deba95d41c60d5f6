"""Evaluation, errors, dropped graphs, second backward, several passes in flight."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from helpers import assert_bit_identical, forward, make_input, make_layers

from cpu_offload import CpuOffloadError, LayerState, get_cpu_offload_context

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

WIDTH = 32


def test_evaluation_under_no_grad(streams):
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    x = make_input("mlp", WIDTH, torch.float32, 0)
    with torch.no_grad():
        expected = forward(layers, x)
        for _ in range(3):
            actual = forward(layers, x, ctx, sync_fn)
            assert torch.equal(expected, actual)
    synchronizer = ctx.offload_synchronizer
    assert synchronizer.stats.tensors_offloaded == 0
    assert synchronizer.get_offloaded_total_size_mb() == 0


def test_exception_in_layer_2_of_4_then_clean_iteration(streams):
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    x = make_input("mlp", WIDTH, torch.float32, 0).requires_grad_()

    class Boom(Exception):
        pass

    def partial(ctx=None, sync_fn=None):
        h = x
        with pytest.raises(Boom):
            for index, layer in enumerate(layers):
                with ctx if ctx is not None else contextlib.nullcontext():
                    h = layer(h)
                    if index == 2:
                        raise Boom
                h = sync_fn(h) if sync_fn is not None else h
        return h

    layers.zero_grad()
    partial().sum().backward()  # without offload the partial graph is usable
    expected_partial = [p.grad.clone() for p in layers[:3].parameters()]
    layers.zero_grad()
    h = partial(ctx, sync_fn)
    synchronizer = ctx.offload_synchronizer
    assert synchronizer.current_pass is None  # the next forward starts a new pass
    h.sum().backward()  # so it is with offload: the pass lives with its graph
    assert_bit_identical(expected_partial, [p.grad.clone() for p in layers[:3].parameters()])
    del h
    assert synchronizer.get_offloaded_total_size_mb() == 0

    layers.zero_grad()
    forward(layers, x).square().mean().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    forward(layers, x, ctx, sync_fn).square().mean().backward()
    assert_bit_identical(expected, [p.grad.clone() for p in layers.parameters()])
    assert synchronizer.stats.tensors_offloaded > 0


def test_graph_dropped_without_backward_returns_host_buffers_to_the_pool(streams):
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    x = make_input("mlp", WIDTH, torch.float32, 0).requires_grad_()
    synchronizer = ctx.offload_synchronizer
    for step in range(3):
        out = forward(layers, x, ctx, sync_fn)  # a validation forward with grad enabled
        (forward_pass,) = synchronizer.in_flight_passes()
        assert synchronizer.get_offloaded_total_size_mb() > 0
        if step == 0:
            allocations = synchronizer.host_buffers.allocations
            assert allocations > 0
        pass_ref = weakref.ref(forward_pass)
        del forward_pass, out
        assert pass_ref() is None  # no gc.collect: no reference cycles
        assert synchronizer.in_flight_passes() == []
        assert synchronizer.get_offloaded_total_size_mb() == 0
    assert synchronizer.host_buffers.allocations == allocations  # reused, not leaked


def test_two_passes_in_flight_then_backwards(streams):
    """Two micro-batches forward, then both backwards (F0 F1 B0 B1)."""
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    inputs = [make_input("mlp", WIDTH, torch.float32, s).requires_grad_() for s in (1, 2)]
    for x in inputs:
        forward(layers, x).square().mean().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    outs = [forward(layers, x, ctx, sync_fn) for x in inputs]
    synchronizer = ctx.offload_synchronizer
    passes = synchronizer.in_flight_passes()
    assert len(passes) == 2 and passes[0].layer_states[0] is not passes[1].layer_states[0]
    assert all(p.layer_states[0].state is LayerState.OFFLOAD_FINISHED for p in passes)
    for out in outs:
        out.square().mean().backward()
    assert_bit_identical(expected, [p.grad.clone() for p in layers.parameters()])
    assert synchronizer.get_offloaded_total_size_mb() == 0


def test_many_iterations_do_not_accumulate_state(streams):
    layers = make_layers("mlp", 3, 8, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(
        True, 2, 3, min_offload_numel=0, retain_pinned_cpu_buffers=True
    )
    synchronizer = ctx.offload_synchronizer
    for step in range(200):
        x = make_input("mlp", 8, torch.float32, step).requires_grad_()
        forward(layers, x, ctx, sync_fn).sum().backward()
        if step == 0:
            first_step_allocations = synchronizer.host_buffers.allocations
    assert synchronizer.in_flight_passes() == []  # no gc.collect: no reference cycles
    assert len(synchronizer._passes) <= 1
    assert first_step_allocations == 2 * 3  # two layers, three saved tensors each
    assert synchronizer.host_buffers.allocations == first_step_allocations


def test_unknown_pass_index_is_an_error():
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2)
    with pytest.raises(CpuOffloadError, match="no forward pass 12345"):
        ctx.offload_synchronizer.resolve_pass(12345)


def test_single_layer_pass_survives_until_sync_fn_and_dies_with_its_graph(streams):
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=1, manual_synchronization=True, min_offload_numel=0
    )
    x = torch.randn(16, 16, requires_grad=True)
    with ctx:
        y = x.sin()
    y = sync_fn(y)  # the pass must still exist here
    controller.start_offload_layer(0)
    controller.release_activation_forward_gpu_memory(0)
    controller.start_reload_layer(0)
    (forward_pass,) = controller.in_flight_passes()
    pass_ref = weakref.ref(forward_pass)
    del forward_pass
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
    del y
    assert pass_ref() is None


def test_retained_buffers_with_changed_shape_then_clean_iteration(streams):
    layers = make_layers("mlp", 3, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(
        True, 1, 3, min_offload_numel=0, retain_pinned_cpu_buffers=True
    )
    x = make_input("mlp", WIDTH, torch.float32, 0).requires_grad_()
    forward(layers, x, ctx, sync_fn).sum().backward()
    synchronizer = ctx.offload_synchronizer
    before = synchronizer.host_memory_stats()
    longer = torch.cat([x, x]).detach().requires_grad_()
    for _ in range(3):  # each error keeps the layer's retained buffers
        with pytest.raises(CpuOffloadError, match=r"retain_pinned_cpu_buffers=True .*layer 0"):
            forward(layers, longer, ctx, sync_fn)  # raised as layer 1 starts the offload of 0
        assert synchronizer.current_pass is None  # the failed pass was discarded
    layers.zero_grad()
    forward(layers, x).sum().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    forward(layers, x, ctx, sync_fn).sum().backward()
    assert_bit_identical(expected, [p.grad.clone() for p in layers.parameters()])
    after = synchronizer.host_memory_stats()
    assert (after["num_host_alloc"], after["reserved_bytes"]) == (
        before["num_host_alloc"],
        before["reserved_bytes"],
    )


def test_release_frees_the_base_of_a_view_moved_through_it(streams):
    """A matmul on a 3-D activation saves a 2-D view of it, which is copied through its
    base.  Once the layer is released its device memory must go: the version keeper of
    the view used to hold the base (``_base``) until the end of backward, so on a device
    a Linear layer's input stayed allocated after its offload."""
    freed: list[int] = []
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    x = torch.randn(2, 8, WIDTH, requires_grad=True)
    for index, layer in enumerate(layers):
        with ctx:
            h = x.sin()  # saved through its base: matmul saves h.view(16, WIDTH)
            weakref.finalize(h.untyped_storage(), freed.append, index)
            x = layer(h)
        x = sync_fn(x)
        del h
    assert sorted(freed) == [0, 1]  # layers 0 and 1 offloaded and released; 2, 3 kept
    x.sum().backward()
    assert sorted(freed) == [0, 1, 2, 3]
