"""offload_layers under what users do to models: interrupts, copies, several threads."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from cpu_offload import CpuOffloadError, is_cpu_offload_enabled, offload_layers

pytestmark = pytest.mark.usefixtures("streams")

L, K = 4, 2


def make_layers(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(L))


def step(layers: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    h = x
    for layer in layers:
        h = layer(h)
    return list(torch.autograd.grad(h.square().sum(), [x, *layers.parameters()]))


def assert_equal(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    assert len(expected) == len(actual)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))


# ------------------------------------------------------------- interrupts


def interrupt_inside(layers: nn.ModuleList, position: int, x: torch.Tensor) -> None:
    """A forward that a KeyboardInterrupt stops inside layer ``position``."""

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    hook = layers[position][0].register_forward_hook(interrupt)  # after the Linear saved
    try:
        h = x
        for layer in layers:
            h = layer(h)
    except KeyboardInterrupt:
        pass
    finally:
        hook.remove()


@pytest.mark.parametrize("position", [0, 1, 3], ids=lambda p: f"layer{p}")
def test_keyboard_interrupt_inside_a_layer_then_a_step(position):
    x = torch.randn(8, 16, requires_grad=True)
    expected = step(make_layers(), x)
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    interrupt_inside(layers, position, x)
    # forward hooks run on Exception only: the context is left at the next forward
    assert_equal(expected, step(layers, x))
    assert not is_cpu_offload_enabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    stats = handle.offload_synchronizer.stats
    assert stats.tensors_offloaded > 0


def test_remove_after_a_keyboard_interrupt_leaves_the_context():
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    interrupt_inside(layers, 1, torch.randn(8, 16, requires_grad=True))
    assert is_cpu_offload_enabled()  # still entered, as hooks left it
    handle.remove()
    assert not is_cpu_offload_enabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_other_hooks_entered_after_an_interrupt_are_named_not_popped():
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    interrupt_inside(layers, 0, torch.randn(8, 16, requires_grad=True))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(CpuOffloadError, match="other saved-tensor hooks were entered after"):
            handle.remove()
    handle.remove()  # once those are left, the offload hooks go
    assert not is_cpu_offload_enabled()


def test_a_layer_nested_in_a_running_layer_is_still_an_error():
    inner = nn.Linear(16, 16)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    outer = Outer()
    offload_layers([outer, inner], 1, min_offload_numel=0)
    with pytest.raises(CpuOffloadError, match="entered again before it was left"):
        outer(torch.randn(2, 16))  # the hooked inner layer runs inside the hooked outer


# ------------------------------------------------------------------ copies


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_hooked_model_runs_without_offload_and_leaves_the_original(how):
    x = torch.randn(8, 16, requires_grad=True)
    expected = step(make_layers(), x)
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    if how == "deepcopy":
        twin = copy.deepcopy(layers)
    else:
        buffer = io.BytesIO()
        torch.save(layers, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    stats = handle.offload_synchronizer.stats
    assert_equal(expected, step(twin, x))
    assert stats.tensors_offloaded == 0  # the copy carries no offloading
    assert_equal(expected, step(layers, x))
    assert stats.tensors_offloaded > 0  # the original still offloads
    own = offload_layers(twin, K, min_offload_numel=0)  # the copy gets hooks of its own
    assert_equal(expected, step(twin, x))
    assert own.offload_synchronizer.stats.tensors_offloaded > 0


# ----------------------------------------------------------------- threads


def test_a_wait_in_another_thread_returns_only_when_the_copy_has_run():
    """The race two threads sharing one handle met under the strict simulator: a copy
    that one thread was running counted as run, and another thread's wait for it
    returned at once, to read its still poisoned destination."""
    from cpu_offload.testing import SimulatedBackend
    from cpu_offload.testing.sim_streams import QueuedCopy as _Copy

    sim = SimulatedBackend()
    stream = sim.new_stream()
    src, dst = torch.ones(4), torch.empty(4)
    sim.copy(dst, src, stream)
    event = sim.new_event()
    event.record(stream)
    started, go, seen = threading.Event(), threading.Event(), []
    run = _Copy.run

    def slow_run(copy: _Copy) -> None:
        started.set()
        go.wait()
        run(copy)

    def first() -> None:
        stream.synchronize()  # runs the copy, slowly

    def second() -> None:
        event.synchronize()  # waits for the same copy
        seen.append(dst.clone())

    _Copy.run = slow_run  # type: ignore[method-assign]
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        threads[0].start()
        started.wait()
        threads[1].start()
        threads[1].join(timeout=1.0)  # before the fix it returned here, the copy not run
        go.set()
        for thread in threads:
            thread.join()
    finally:
        _Copy.run = run  # type: ignore[method-assign]
    assert len(seen) == 1 and torch.equal(seen[0], src)


def test_two_threads_run_forward_and_backward_through_one_model(streams):
    """Two threads share one handle, with inputs of different shapes, in every stream
    flavour (the simulators' queues are shared: NOTE [Threads] in simulator.py)."""
    inputs = [torch.randn(rows, 16, requires_grad=True) for rows in (8, 40)]
    plain = make_layers()
    expected = [step(plain, x) for x in inputs]
    layers = make_layers()
    handle = offload_layers(layers, K, min_offload_numel=0)
    barrier = threading.Barrier(2)
    results: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for _ in range(20):
                barrier.wait()  # both threads forward at once
                results[index].append(step(layers, inputs[index]))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in range(2):
        assert len(results[index]) == 20
        for grads in results[index]:
            assert_equal(expected[index], grads)
    assert handle.offload_synchronizer.stats.forward_passes == 40
