"""A graph retained for a second backward (NOTE [A backward in two phases]): the manual
controller keeps every reload (TransformerEngine's contract), and a loop of full backwards
with ``retain_graph=True``.  Parity rows: each program's gradients equal the plain run's,
on the host path and every simulated stream flavour."""

from __future__ import annotations

import pytest
import torch

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


def retained_loop(k: int | None, steps: int = 3):
    """A training loop that passes ``retain_graph=True`` to every (single) backward."""
    layers = make_layers()
    ctx = sync_fn = None
    if k is not None:
        ctx, sync_fn = get_cpu_offload_context(True, k, L, min_offload_numel=0)
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
        h.square().sum().backward(retain_graph=True)
    result = grads(layers, x)
    return result, None if ctx is None else ctx.offload_synchronizer.stats


@pytest.mark.parametrize("k", [1, L - 1])
def test_a_loop_of_retained_backwards_computes_what_autograd_computes(k):
    expected, _ = retained_loop(None)
    actual, stats = retained_loop(k)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert stats.tensors_offloaded > 0
