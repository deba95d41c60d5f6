"""Nothing outlives its graph: a forward dropped without a backward frees everything.

The garbage collector is switched off in these tests: the memory must go when the
last reference to the graph goes, by reference counting alone, as it does without
offload (a cycle through C++ autograd nodes is one the collector cannot see anyway).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from cpu_offload import get_cpu_offload_context, offload_layers

pytestmark = pytest.mark.usefixtures("streams")

L, K, STEPS = 4, 2, 5


class Interrupted(Exception):
    pass


@pytest.fixture(autouse=True)
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def make_layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(L))


def assert_nothing_held(synchronizer, outputs: list[StorageWeakRef]) -> None:
    assert synchronizer.in_flight_passes() == []
    assert synchronizer.host_memory_stats()["in_use_bytes"] == 0
    assert [ref.expired() for ref in outputs] == [True] * len(outputs)


def outputs_of(layers: nn.ModuleList) -> tuple[list[StorageWeakRef], list]:
    """Record (weakly) the storage of every layer output, through forward hooks."""
    outputs: list[StorageWeakRef] = []

    def record(module, args, output):
        outputs.append(StorageWeakRef(output.untyped_storage()))

    return outputs, [layer.register_forward_hook(record) for layer in layers]


def raising(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Run ``layer`` with an exception raised inside its forward, after it saved tensors."""

    def fail(module, args, output):
        raise Interrupted

    hook = layer[1].register_forward_hook(fail)  # after the Linear and the Tanh saved
    try:
        return layer(h)
    finally:
        hook.remove()


@pytest.mark.parametrize("where", [0, 1, 2, 3], ids=lambda w: f"raise-in-layer{w}")
def test_offload_layers_exception_inside_a_layer_frees_everything(where):
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    synchronizer = handle.offload_synchronizer
    outputs, hooks = outputs_of(layers)
    for _ in range(STEPS):
        outputs.clear()
        x = torch.randn(8, 16, requires_grad=True)
        try:
            h = x
            for index, layer in enumerate(layers):
                h = layer(h) if index != where else raising(layer, h)
        except Interrupted:
            pass
        del h
        assert_nothing_held(synchronizer, outputs)
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("where", [0, 1, 3], ids=lambda w: f"interrupt-in-layer{w}")
def test_offload_layers_keyboard_interrupt_inside_a_layer_frees_everything(where):
    """A KeyboardInterrupt inside a layer (forward hooks do not run on it, so the context
    stays entered): the failed step's memory goes with its graph, before the next forward."""
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    synchronizer = handle.offload_synchronizer
    outputs, hooks = outputs_of(layers)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    inner = layers[where][1].register_forward_hook(interrupt)  # after the layer saved
    x = torch.randn(8, 16, requires_grad=True)
    h = x
    try:
        for layer in layers:
            h = layer(h)
    except KeyboardInterrupt:
        pass
    del h
    assert_nothing_held(synchronizer, outputs)
    inner.remove()
    for hook in hooks:
        hook.remove()
    handle.remove()


@pytest.mark.parametrize("inside", [True, False], ids=["inside-ctx", "between-layers"])
def test_context_exception_mid_forward_frees_everything(inside):
    layers = make_layers()
    ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    outputs, hooks = outputs_of(layers)
    for _ in range(STEPS):
        outputs.clear()
        x = torch.randn(8, 16, requires_grad=True)
        h = x
        try:
            for index, layer in enumerate(layers):
                with ctx:
                    h = layer(h)
                    if inside and index == 2:
                        raise Interrupted
                h = sync_fn(h)
                if index == 2:
                    raise Interrupted
        except Interrupted:
            pass
        del h
        assert_nothing_held(synchronizer, outputs)
    # and a full step afterwards computes the plain gradients
    plain = make_layers()
    x = torch.randn(8, 16)
    h, g = x, x
    for layer, twin in zip(layers, plain):
        with ctx:
            h = layer(h)
        h = sync_fn(h)
        g = twin(g)
    h.sum().backward()
    g.sum().backward()
    for a, b in zip(layers.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize(
    "calls", [(), ("offload",), ("offload", "release")], ids=["no-calls", "offload", "released"]
)
def test_manual_layers_not_reloaded_are_freed_with_their_graph(calls):
    layers = make_layers()
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=L, manual_synchronization=True, min_offload_numel=0
    )
    outputs, hooks = outputs_of(layers)
    for _ in range(STEPS):
        outputs.clear()
        h = torch.randn(8, 16, requires_grad=True)
        for index, layer in enumerate(layers):
            with ctx:
                h = layer(h)
            h = sync_fn(h)
            if "offload" in calls:
                controller.start_offload_layer(index)
        if "release" in calls:
            for index in range(L):
                controller.release_activation_forward_gpu_memory(index)
        del h  # dropped without backward
        assert_nothing_held(controller, outputs)
    for hook in hooks:
        hook.remove()


def test_saved_outputs_with_their_own_node_are_freed_with_the_graph():
    """An output saved by the node that made it (tanh, exp) carries that node; a layer
    that keeps it on the device (below the threshold) must not hold the node."""
    layers = make_layers()
    handle = offload_layers(layers, K)  # default threshold: every tensor stays
    outputs, hooks = outputs_of(layers)
    h = torch.randn(8, 16, requires_grad=True)
    for layer in layers:
        h = layer(h)
    del h
    assert handle.offload_synchronizer.stats.tensors_offloaded == 0
    assert_nothing_held(handle.offload_synchronizer, outputs)
    for hook in hooks:
        hook.remove()
