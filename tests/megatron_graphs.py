"""Capture-and-replay rows shared by the Megatron-Core tests (issue 53): a training step
captured whole on the modeled accelerator's data mode (``timed_runtime(data=True)``,
NOTE [Data-mode replay]) after an eager warm-up step, replayed per batch, against the
same step eager without offload."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cuda_graph_steps import Replays, capture_and_replay
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

        def load(batch: list[torch.Tensor]) -> None:
            for buffer, value in zip(static, batch):
                buffer.copy_(value)

        capture_and_replay(live, captured_step, grads, load, data, found)
        found.report = reports.report()
    found.hazards = live.strict.counters.hazards
    return found
