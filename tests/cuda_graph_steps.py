"""Steps captured and replayed on the modeled accelerator, shared by the CUDA-graph tests
(issue 53): the bytes a block moved, what the warm-up step and each replay computed,
the capture-and-replay loop of a whole step, and the layers a per-layer graph takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers import assert_bit_identical, forward


def squared_loss(
    layers: Sequence[torch.nn.Module], x: torch.Tensor, ctx: Any = None, sync_fn: Any = None
) -> torch.Tensor:
    """The layers' forward (in ``ctx``, then ``sync_fn``, when given) and its squared sum."""
    return forward(layers, x, ctx, sync_fn).square().sum()


def step(layers: Any, x: torch.Tensor, ctx: Any, sync_fn: Any) -> None:
    """A training step through ``layers`` in the offload context: the output's sum, backward."""
    forward(layers, x, ctx, sync_fn).sum().backward()


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
    """What an eager warm-up step and each replay (or step through graphed layers) moved
    and computed, the report after them, and the strict simulator's hazards."""

    eager: tuple[tuple[int, int], list[torch.Tensor]] | None = None
    replays: list[tuple[tuple[int, int], list[torch.Tensor]]] = field(default_factory=list)
    report: Any = None
    hazards: int = -1


class StaticStep:
    """A step a graph can capture, through ``model``'s layers: a static input of
    ``shape``, its gradient and the parameters' preallocated (the graph accumulates into
    them) and zeroed by each call, which returns the loss.  ``ctx`` and ``sync_fn``, the
    offload context the layers run in, are set once it exists."""

    def __init__(self, model: torch.nn.ModuleList, shape: tuple[int, ...]) -> None:
        self.model = model
        self.x = torch.zeros(shape, requires_grad=True)
        self.x.grad = torch.zeros_like(self.x)
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        self.grads = [self.x.grad, *(p.grad for p in model.parameters())]
        self.ctx: Any = None
        self.sync_fn: Any = None

    def load(self, x: torch.Tensor) -> None:
        self.x.detach().copy_(x)

    def __call__(self) -> torch.Tensor:
        for grad in self.grads:
            grad.zero_()
        loss = squared_loss(self.model, self.x, self.ctx, self.sync_fn)
        loss.backward()
        return loss


def capture_and_replay(
    live: Any,
    step: Callable[[], torch.Tensor],
    grads: list[torch.Tensor],
    load: Callable[[Any], None],
    data: list,
    found: Replays,
    before_capture: Callable[[], Any] | None = None,
) -> None:
    """Into ``found``: ``step()`` eager on ``data[0]`` (the warm-up), then captured whole
    by the runtime's ``graph`` (the capture moves nothing) and replayed per batch,
    ``load(batch)`` copying each into the static input first; the values are the loss
    and ``grads``.  ``before_capture()`` runs between the warm-up and the capture."""
    load(data[0])
    moved = Moved(live)
    loss = step()
    found.eager = moved.since(), [loss.detach().clone(), *(g.clone() for g in grads)]
    if before_capture is not None:
        before_capture()
    graph = live.CUDAGraph()
    moved = Moved(live)
    with live.graph(graph, stream=live.Stream()):
        static_loss = step()
    assert moved.since() == (0, 0)  # capture moves nothing
    for batch in data:
        load(batch)
        moved = Moved(live)
        graph.replay()
        values = [static_loss.detach().clone(), *(g.clone() for g in grads)]
        found.replays.append((moved.since(), values))


def assert_values_and_bytes(found: Replays, want: list[list[torch.Tensor]]) -> None:
    """The warm-up step (eager, with offload) and each replay compute eager's values
    without offload and move the warm-up step's bytes; no strict hazard."""
    assert found.eager is not None
    (d2h, h2d), values = found.eager
    assert d2h == h2d > 0
    assert_bit_identical(want[0], values)
    assert len(found.replays) == len(want)
    for (moved, values), wanted in zip(found.replays, want):
        assert moved == (d2h, h2d)
        assert_bit_identical(wanted, values)
    assert found.hazards == 0


def assert_replays_eager(found: Replays, want: list[list[torch.Tensor]]) -> None:
    """:func:`assert_values_and_bytes`, and the report says one capture was replayed."""
    assert_values_and_bytes(found, want)
    steps = found.report.cuda_graph
    assert (steps.captured, steps.replay, steps.captures) == (True, True, 1)


class InContext(torch.nn.Module):
    """A layer that enters the offload context inside its forward, as Megatron's do."""

    def __init__(self, layer: torch.nn.Module, ctx: Any, sync_fn: Any) -> None:
        super().__init__()
        self.layer, self.ctx, self.sync_fn = layer, ctx, sync_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx:
            y = self.layer(x)
        return self.sync_fn(y)  # type: ignore[no-any-return]


class Outer(torch.nn.Module):
    """A module around a layer that ``offload_layers`` hooked (``make_graphed_callables``
    takes no module with hooks of its own)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # type: ignore[no-any-return]
