"""Capture-and-replay rows shared by the Megatron-Core tests (issue 53): a training step
captured whole on the modeled accelerator's data mode (``timed_runtime(data=True)``,
NOTE [Data-mode replay]) after an eager warm-up step, replayed per batch, against the
same step eager without offload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers import modeled_device

from cpu_offload.testing import timed_runtime

DEVICE = modeled_device()
FLAVOURS = ["cuda", "npu"]
#: (not "npu" alone: conftest skips tests with that keyword without an Ascend NPU)
FLAVOUR_IDS = [f"modeled {flavour}" for flavour in FLAVOURS]


def model_and_loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """The step: Megatron's per-token loss, its mean, and the backward."""
    tokens, positions, mask = batch
    loss = model(tokens, positions, mask, labels=tokens).float().mean()
    loss.backward()
    return loss


def expected(model: torch.nn.Module, data: list, step: Callable) -> list[list[torch.Tensor]]:
    """Per batch: the loss and every parameter's gradient of ``model`` (not offloading)."""
    found = []
    for batch in data:
        model.zero_grad(set_to_none=True)
        loss = step(model, batch)
        found.append([loss.detach(), *(p.grad for p in model.parameters())])
    return found


def assert_equal(want: list[torch.Tensor], have: list[torch.Tensor]) -> None:
    assert len(want) == len(have)
    for a, b in zip(want, have):
        assert a.dtype == b.dtype and torch.equal(a, b)


class Moved:
    """The bytes a block moved each way on the runtime's copy engines."""

    def __init__(self, live: Any) -> None:
        self.live = live
        self.start = dict(live.timeline.copied)

    def since(self) -> tuple[int, int]:
        copied = self.live.timeline.copied
        return copied["d2h"] - self.start["d2h"], copied["h2d"] - self.start["h2d"]


@dataclass
class Replays:
    """What the eager warm-up step and each replay moved and computed, the report
    after them, and the strict simulator's hazards."""

    eager: tuple[tuple[int, int], list[torch.Tensor]] | None = None
    replays: list[tuple[tuple[int, int], list[torch.Tensor]]] = field(default_factory=list)
    report: Any = None
    hazards: int = -1


def whole_step(
    flavour: str, build: Callable[[], tuple[torch.nn.Module, Any]], step: Callable, data: list
) -> Replays:
    """``build()`` (inside the runtime: the offloading model, and what reports), its
    warm-up step eager, then the step captured whole by the runtime's ``graph`` and
    replayed per batch, copied into the static one first."""
    found = Replays()
    with timed_runtime(DEVICE, flavour=flavour, data=True) as run:
        live = run.live
        model, reports = build()
        for parameter in model.parameters():  # preallocated: the graph accumulates into them
            parameter.grad = torch.zeros_like(parameter)
        grads = [p.grad for p in model.parameters()]
        static = [t.clone() for t in data[0]]

        def captured_step() -> torch.Tensor:
            for grad in grads:
                grad.zero_()
            return step(model, static)  # type: ignore[no-any-return]

        moved = Moved(live)
        loss = captured_step()
        found.eager = moved.since(), [loss.detach().clone(), *(g.clone() for g in grads)]
        graph = live.CUDAGraph()
        moved = Moved(live)
        with live.graph(graph, stream=live.Stream()):
            static_loss = captured_step()
        assert moved.since() == (0, 0)  # capture moves nothing
        for batch in data:
            for buffer, value in zip(static, batch):
                buffer.copy_(value)
            moved = Moved(live)
            graph.replay()
            values = [static_loss.detach().clone(), *(g.clone() for g in grads)]
            found.replays.append((moved.since(), values))
        found.report = reports.report()
    found.hazards = live.strict.counters.hazards
    return found


def assert_replays_eager(found: Replays, want: list[list[torch.Tensor]]) -> None:
    """The warm-up step and each replay compute eager's values without offload and
    move the warm-up step's bytes; no strict hazard; the report says so."""
    assert found.eager is not None
    (d2h, h2d), values = found.eager
    assert d2h == h2d > 0
    assert_equal(want[0], values)
    assert len(found.replays) == len(want)
    for (moved, values), wanted in zip(found.replays, want):
        assert moved == (d2h, h2d)
        assert_equal(wanted, values)
    assert found.hazards == 0
    steps = found.report.cuda_graph
    assert (steps.captured, steps.replay, steps.captures) == (True, True, 1)
