"""A graph retained for a second backward (NOTE [A backward in two phases]): the manual
controller keeps every reload (TransformerEngine's contract); a loop of full backwards
with ``retain_graph=True`` reloads nothing for a second backward that does not come, and
one that comes (full, or ZB-V's ``W``) finds its reloads prefetched.  Parity rows: each
program's gradients equal the plain run's, on the host path and every simulated stream
flavour."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import forward
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from cpu_offload import LayerState, get_cpu_offload_context

pytestmark = pytest.mark.usefixtures("streams")

L = 3
WIDTH = 16


def make_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(WIDTH, WIDTH) for _ in range(L)]


def grads(layers: list[torch.nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone()] + [p.grad.clone() for layer in layers for p in layer.parameters()]


def manual_twice(offload: bool, prefetch_twice: bool = False):
    """Manual mode: every layer offloaded and reloaded by the controller, a backward with
    the graph retained, the controller's reloads again, a second backward."""
    layers = make_layers()
    x = torch.randn(8, WIDTH, requires_grad=True)
    h = x
    if not offload:
        for layer in layers:
            h = layer(h).relu()
        loss = h.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return grads(layers, x), None
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=L, manual_synchronization=True, min_offload_numel=0
    )
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h).relu()
        h = sync_fn(h)
        controller.start_offload_layer(i)
    for i in range(L):
        controller.release_activation_forward_gpu_memory(i)
    for i in reversed(range(L)):
        controller.start_reload_layer(i)
    loss = h.square().sum()
    loss.backward(retain_graph=True)
    states = [controller.layer_states[i].state for i in range(L)]
    for i in reversed(range(L)):
        controller.start_reload_layer(i)  # no reload was started for it: the controller's
        if prefetch_twice:
            controller.start_reload_layer(i)  # already reloading: harmless
    loss.backward()
    return grads(layers, x), (states, controller.stats)


@pytest.mark.parametrize("prefetch_twice", [False, True], ids=["once", "prefetched twice"])
def test_manual_mode_leaves_the_second_backwards_reloads_to_the_controller(prefetch_twice):
    expected, _ = manual_twice(False)
    actual, (states, stats) = manual_twice(True, prefetch_twice)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    # after the first backward every layer waits on the host, none reloading
    assert states == [LayerState.OFFLOAD_FINISHED] * L
    assert stats.tensors_reloaded == 2 * stats.tensors_offloaded > 0
    assert stats.on_demand_reloads == 0


def retained_loop(k: int | None, steps: int = 3, second: str | None = None):
    """A training loop that passes ``retain_graph=True`` to every backward; ``second``:
    after the last one, a second backward through its graph (``"full"``: ``backward()``,
    ``"weights"``: ZB-V's ``W``, the weights' gradients from the nodes where their paths
    meet the input's), else none."""
    layers = make_layers()
    ctx = sync_fn = None
    if k is not None:
        ctx, sync_fn = get_cpu_offload_context(True, k, L, min_offload_numel=0)
    reloads = []  # per step: (copied_bytes, reloaded_bytes) of the step report
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(8, WIDTH, requires_grad=True)
        h = x
        for layer in layers:
            if ctx is None:
                h = layer(h).relu()
                continue
            with ctx:
                h = layer(h).relu()
            h = sync_fn(h)
        loss = h.square().sum()
        parameters = [p for layer in layers for p in layer.parameters()]
        if second == "weights" and step == steps - 1:
            _, groups = stage_backward_input([loss], None, [x], iter(parameters))
            stage_backward_weight(iter(parameters), groups)
        else:
            loss.backward(retain_graph=True)
            if second == "full" and step == steps - 1:
                loss.backward()
        if ctx is not None:
            scalars = ctx.report().to_dict()
            reloads.append((scalars["copied_bytes"], scalars["reloaded_bytes"]))
    result = grads(layers, x)
    return result, None if ctx is None else (ctx.offload_synchronizer.stats, reloads)


@pytest.mark.parametrize("k", [1, L - 1])
@pytest.mark.parametrize("second", [None, "full", "weights"])
def test_a_loop_of_retained_backwards_computes_what_autograd_computes(k, second):
    expected, _ = retained_loop(None, second=second)
    actual, (stats, _) = retained_loop(k, second=second)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert stats.tensors_offloaded > 0
    assert stats.on_demand_reloads == 0  # a second backward's reloads were prefetched


@pytest.mark.parametrize("k", [1, L - 1])
def test_a_loop_of_retained_backwards_reloads_nothing_unused(k):
    """No backward but the first comes: each offloaded tensor is copied back once, for
    it, and nothing is reloaded for a second backward (NOTE [A backward in two phases])."""
    steps = 4
    _, (stats, reloads) = retained_loop(k, steps)
    assert stats.forward_passes == steps
    assert stats.tensors_reloaded == stats.tensors_offloaded > 0
    assert stats.bytes_reloaded == stats.bytes_offloaded
    assert all(reloaded == copied > 0 for copied, reloaded in reloads), reloads


@pytest.mark.parametrize("second", ["full", "weights"])
def test_a_second_backward_reloads_each_layer_once_more(second):
    """After a loop of single backwards, the last step's second backward brings every
    offloaded tensor back once more, no more."""
    steps = 3
    _, (stats, _) = retained_loop(L - 1, steps, second)
    per_step = stats.tensors_offloaded // steps
    assert stats.tensors_reloaded == stats.tensors_offloaded + per_step


def split_with_a_layer_without_weights(offload: bool):
    """ZB-V's two phases (I, then W) through linear, sin, linear: the sin layer has no
    weight, so W never unpacks it."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    blocks = [first, torch.sin, last]
    ctx = sync_fn = None
    if offload:
        ctx, sync_fn = get_cpu_offload_context(True, 2, L, min_offload_numel=0)
    x = torch.randn(8, WIDTH, requires_grad=True)
    h = forward(blocks, x, ctx, sync_fn)
    parameters = [*first.parameters(), *last.parameters()]
    _, groups = stage_backward_input([h.square().sum()], None, [x], iter(parameters))
    stage_backward_weight(iter(parameters), groups)
    result = [x.grad.clone()] + [p.grad.clone() for p in parameters]
    return result, None if ctx is None else ctx.offload_synchronizer.stats


def test_a_second_backward_reloads_only_the_layers_it_comes_back_to():
    """W comes back to the linear layers alone: the sin layer (offloaded, one saved
    tensor, as the first linear layer's input) is reloaded for I and not again."""
    expected, _ = split_with_a_layer_without_weights(False)
    actual, stats = split_with_a_layer_without_weights(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert stats.tensors_offloaded == 2
    assert stats.tensors_reloaded == 3  # both for I, the first linear layer's for W
    assert stats.on_demand_reloads == 0


def test_a_backward_that_raises_holds_no_node_of_the_graph():
    """The nodes a backward noted go with it: after one that raised, dropping the graph
    frees the pass at once, without the garbage collector."""

    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("backward raised")

    layers = make_layers()
    ctx, sync_fn = get_cpu_offload_context(True, 1, L, min_offload_numel=0)
    h = Raises.apply(torch.randn(8, WIDTH, requires_grad=True))
    for layer in layers:
        with ctx:
            h = layer(h).relu()
        h = sync_fn(h)
    loss = h.square().sum()
    synchronizer = ctx.offload_synchronizer
    gc.disable()
    try:
        with pytest.raises(ValueError, match="backward raised"):
            loss.backward(retain_graph=True)
        assert len(synchronizer.in_flight_passes()) == 1
        del loss, h
        assert synchronizer.in_flight_passes() == []
        assert synchronizer.host_memory_stats()["in_use_bytes"] == 0
    finally:
        gc.enable()
