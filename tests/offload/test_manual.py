"""The manual synchronizer driven by hand."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import CpuOffloadError, LayerState, OffloadStateError, get_cpu_offload_context

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

L = 4


def make_layers():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(L)]


def reference_grads(layers, inputs):
    for layer in layers:
        layer.zero_grad()
    for i, layer in enumerate(layers):
        layer(inputs[i]).sum().backward()
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


def test_docstring_order_offload_release_reload_backward(streams):
    """The order of the reference's docstring: each layer its own graph."""
    layers = make_layers()
    inputs = [torch.randn(16, 32, requires_grad=True) for _ in range(L)]
    expected = reference_grads(layers, inputs)
    for layer in layers:
        layer.zero_grad()
    stream = None
    if streams is not None:
        stream = streams.new_stream()
    ctx, sync_fn, controller = get_cpu_offload_context(
        True,
        model_layers=L,
        manual_synchronization=True,
        offload_stream=stream,
        min_offload_numel=0,
    )
    outs = []
    for i in range(L):
        with ctx:
            out = layers[i](inputs[i])
        outs.append(sync_fn(out))
        controller.start_offload_layer(i)
    if stream is not None:
        stream.synchronize()
    for i in range(L):
        controller.release_activation_forward_gpu_memory(i)
    assert controller.get_offloaded_total_size_mb() > 0
    for i in reversed(range(L)):
        controller.start_reload_layer(i)
    if stream is not None:
        assert controller.offload_stream is stream
        stream.synchronize()
    for i in range(L):
        outs[i].sum().backward()
    actual = [p.grad.clone() for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert controller.get_offloaded_total_size_mb() == 0
    assert controller.stats.tensors_offloaded == controller.stats.tensors_reloaded > 0


def test_layer_without_calls_is_not_offloaded(streams):
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=2, manual_synchronization=True, min_offload_numel=0
    )
    x = torch.randn(8, 8, requires_grad=True)
    for _i in range(2):
        with ctx:
            x = x.exp()
        x = sync_fn(x)
    controller.start_offload_layer(1)
    controller.release_activation_forward_gpu_memory(1)
    controller.start_reload_layer(1)
    states = controller.layer_states
    assert states[0].state is LayerState.NOT_OFFLOADED and states[0].num_offloaded_tensors == 0
    x.sum().backward()
    assert controller.stats.tensors_offloaded == 1


def test_chained_layers_one_backward(streams):
    layers = make_layers()
    x0 = torch.randn(16, 32, requires_grad=True)
    x = x0
    for layer in layers:
        x = layer(x)
    x.sum().backward()
    expected = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad()
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=L, manual_synchronization=True, min_offload_numel=0
    )
    x = x0
    for i, layer in enumerate(layers):
        with ctx:
            x = layer(x)
        x = sync_fn(x)
        if i >= 1:
            controller.start_offload_layer(i - 1)
        if i >= 2:
            controller.release_activation_forward_gpu_memory(i - 2)
    controller.release_activation_forward_gpu_memory(L - 3 + 1)
    for i in reversed(range(L - 1)):
        controller.start_reload_layer(i)
    x.sum().backward()
    actual = [p.grad.clone() for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))


def test_manual_illegal_orders_raise(streams):
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=2, manual_synchronization=True, min_offload_numel=0
    )
    with pytest.raises(CpuOffloadError, match="no forward pass in flight"):
        controller.start_offload_layer(0)
    x = torch.randn(8, 8, requires_grad=True)
    with ctx:
        y = x.exp()
    y = sync_fn(y)
    with pytest.raises(OffloadStateError, match=r"layer 0 .*NOT_OFFLOADED"):
        controller.start_reload_layer(0)
    with pytest.raises(ValueError, match=r"layer_id must be an int in \[0, 1\]"):
        controller.start_offload_layer(5)
    for wrong in (True, 0.0, "0"):
        with pytest.raises(TypeError, match=r"layer_id must be an int in \[0, 1\], got"):
            controller.start_offload_layer(wrong)
    controller.start_offload_layer(0)
    with pytest.raises(OffloadStateError, match="OFFLOAD_STARTED"):
        controller.start_offload_layer(0)
    y.sum().backward()


def test_offload_stream_that_is_not_a_stream_is_refused_at_the_call():
    with pytest.raises(TypeError, match="offload_stream must be a stream of the device.*got str"):
        get_cpu_offload_context(
            True, model_layers=2, manual_synchronization=True, offload_stream="not a stream"
        )
