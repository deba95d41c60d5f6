"""offload_layers(memory_budget=...)'s bookkeeping (issue 40): a budget never silently off
(a frozen first layer under no_grad, a last layer skipped, no plan said once), a layer
skipped in the measured step measured when it first runs, "auto" read after the first
optimizer step, the peak watch comparing activations with activations, and nothing of a
failed step held after its error (with the garbage collector off)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from cpu_offload import offload_layers

WIDTH = 16
LAYERS = 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def blocks() -> list[Block]:
    torch.manual_seed(0)
    return [Block() for _ in range(LAYERS)]


def run(layers: list[Block], x: torch.Tensor, skip: set[int] = frozenset(), frozen: int = -1):
    """A forward through ``layers``: those in ``skip`` do not run (LayerDrop); layers up
    to ``frozen`` run under no_grad."""
    h = x
    for index, layer in enumerate(layers):
        if index in skip:
            continue
        if index <= frozen:
            with torch.no_grad():
                h = layer(h)
        else:
            h = layer(h)
    return h


def step(layers: list[Block], x: torch.Tensor, **how) -> list[torch.Tensor]:
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    run(layers, x, **how).square().sum().backward()
    return [p.grad.clone() if p.grad is not None else None for m in layers for p in m.parameters()]


def same(a: list, b: list) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def no_warnings(fn: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


# ------------------------------------------------------------- 1: never silently off


def test_a_frozen_first_layer_under_no_grad_is_measured_as_saving_nothing(capsys):
    layers, x = blocks(), torch.randn(64, WIDTH)
    plain = step(layers, x, frozen=0)
    handle = offload_layers(layers, memory_budget="40000B", min_offload_numel=0)
    stats = handle.offload_synchronizer.stats
    for index in range(3):
        before = stats.bytes_offloaded
        assert same(plain, step(layers, x, frozen=0)), index
        if index > 0:
            assert stats.bytes_offloaded - before == handle.plan.predicted.offloaded_bytes
    plan, measured = handle.plan, handle.auto.measured
    assert plan is not None and "no plan yet" not in repr(handle)
    assert measured[0].saved_bytes == 0 and measured[0].input_bytes == 0
    assert all(layer.saved_bytes > 0 for layer in measured[1:])
    assert plan.layer_costs[0].saved_bytes == 0 and plan.policy != ["keep"] * LAYERS
    assert stats.bytes_offloaded > 0
    handle.remove()


def test_a_last_layer_skipped_in_every_step_does_not_stop_the_plan(capsys):
    layers, x = blocks(), torch.randn(64, WIDTH)
    plain = step(layers, x, skip={LAYERS - 1})
    handle = offload_layers(layers, memory_budget="40000B", min_offload_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert same(plain, step(layers, x, skip={LAYERS - 1}))
    assert handle.plan is not None and handle.plan.policy != ["keep"] * LAYERS
    assert handle.auto.measured[LAYERS - 1] is None  # never ran: never measured
    said = [str(w.message) for w in caught if "did not run in the measured step" in str(w.message)]
    assert len(said) == 1 and f"layers [{LAYERS - 1}] did not run" in said[0]
    handle.remove()


def test_a_budget_without_a_plan_says_why_once():
    layers, x = blocks(), torch.randn(64, WIDTH)
    handle = offload_layers(layers, memory_budget="40000B", min_offload_numel=0)
    assert "the first step runs as the model does, measured" in repr(handle)

    def evaluate() -> None:
        with torch.no_grad():
            for _ in range(8):
                run(layers, x)

    said = [m for m in no_warnings(evaluate) if "no plan after" in m]
    assert said == [
        "cpu_offload: offload_layers(memory_budget=...): no plan after 4 forward passes, so "
        "nothing is offloaded or checkpointed: no layer of a forward pass ran with grad "
        "enabled (evaluation, or torch.no_grad() around the whole forward). This warning "
        "is shown once."
    ]
    assert "no layer of a forward pass ran with grad enabled" in repr(handle)
    handle.remove()


# ------------------------------------------------------ 2: a layer skipped when measured


def test_a_layer_skipped_in_the_measured_step_is_measured_when_it_runs(capsys):
    layers, x = blocks(), torch.randn(64, WIDTH)
    skipped = step(layers, x, skip={2})
    plain = step(layers, x)
    handle = offload_layers(layers, memory_budget="40000B", min_offload_numel=0)
    stats = handle.offload_synchronizer.stats
    assert same(skipped, step(layers, x, skip={2}))  # the measured step: layer 2 dropped
    assert handle.auto.measured[2] is None and handle.plan is None
    with pytest.warns(UserWarning) as caught:
        assert same(plain, step(layers, x))  # planned from a stand-in; layer 2 measured now
    messages = [str(w.message) for w in caught]
    assert any("layers [2] did not run in the measured step" in m for m in messages)
    assert any("layer 2, which did not run in the measured step" in m for m in messages)
    first = handle.plan
    assert "not measured yet" in " ".join(first.checkpoint_refused)
    assert handle.auto.measured[2].saved_bytes == handle.auto.measured[1].saved_bytes
    before = stats.bytes_offloaded
    assert same(plain, step(layers, x))
    second = handle.plan
    assert second is not first  # planned again from what layer 2 saved
    assert stats.bytes_offloaded - before == second.predicted.offloaded_bytes
    assert second.layer_costs[2].saved_bytes == second.layer_costs[1].saved_bytes
    handle.remove()


# ---------------------------------------------- 3: "auto" after the first optimizer step


def test_auto_is_read_after_the_first_optimizer_step_with_accumulation(monkeypatch, capsys):
    import cpu_offload.device.backend

    layers, x = blocks(), torch.randn(64, WIDTH)
    parameters = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    machine = 8 * 2**20

    def state_bytes() -> int:
        return sum(
            t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )

    free = lambda: machine - state_bytes()  # noqa: E731
    monkeypatch.setattr(cpu_offload.device.backend, "host_memory_available", free)
    handle = offload_layers(layers, memory_budget="auto", min_offload_numel=0)
    accumulation = 3
    for micro in range(accumulation):
        run(layers, x).square().sum().backward()
        assert handle.plan is None, micro  # before the optimizer's state exists
    assert state_bytes() == 0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = state_bytes()
    assert state > 2 * sum(p.nbytes for p in parameters)  # Adam's two moments, its steps
    run(layers, x).square().sum().backward()
    gradients = sum(p.nbytes for p in parameters)  # set to None before this pass
    assert handle.plan.memory_budget == int((machine - state) * 0.9) - gradients
    handle.remove()


def test_another_models_optimizer_does_not_count():
    from cpu_offload.policy.budget_watch import OptimizerWatch

    ours, theirs = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    watch = OptimizerWatch([ours])
    theirs.grad = torch.ones(2)
    torch.optim.SGD([theirs], lr=0.1).step()
    assert not watch.stepped
    ours.grad = torch.ones(2)
    torch.optim.SGD([ours], lr=0.1).step()
    assert watch.stepped
