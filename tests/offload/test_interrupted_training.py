"""200 steps with interruptions, varying lengths and an identity layer stay in step."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from cpu_offload import get_cpu_offload_context, offload_layers

pytestmark = pytest.mark.usefixtures("streams")

WIDTHS = [4, 6, 8, 10, 12, 14]  # layer i maps WIDTHS[i] -> WIDTHS[i + 1]: distinct sizes
IDENTITY = 2  # this position returns its input
L, K = len(WIDTHS) - 1, 3


class Interrupted(Exception):
    pass


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def make_model() -> nn.ModuleList:
    torch.manual_seed(0)
    layers = []
    for index in range(L):
        if index == IDENTITY:
            layers.append(Identity())
        else:
            width_in = WIDTHS[index] if index != IDENTITY + 1 else WIDTHS[IDENTITY]
            layers.append(nn.Sequential(nn.Linear(width_in, WIDTHS[index + 1]), nn.Tanh()))
    return nn.ModuleList(layers)


def layer_bytes(index: int, seq: int) -> int:
    """Bytes layer ``index`` offloads: its input and its tanh output (fp32)."""
    if index == IDENTITY:
        return 0
    width_in = WIDTHS[index] if index != IDENTITY + 1 else WIDTHS[IDENTITY]
    return 4 * seq * (width_in + WIDTHS[index + 1])


def train(
    api: str | None, between: bool = True, steps: int = 200
) -> tuple[list[torch.Tensor], list[tuple[int, int]], list[bool]]:
    """Returns the parameters after training and, per finished step, (expected bytes,
    offloaded bytes) and whether the step before it was interrupted.

    Steps are interrupted inside a layer or, with ``between``, also between two layers.
    """
    layers = make_model()
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.01)
    rng = random.Random(1)
    ctx = sync_fn = handle = None
    if api == "context":
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0)
        synchronizer = ctx.offload_synchronizer
    elif api == "layers":
        handle = offload_layers(layers, K, min_offload_numel=0)
        synchronizer = handle.offload_synchronizer
    observed = []
    after_interruption = []  # per finished step: whether the step before it was interrupted
    interrupted = False
    for _ in range(steps):
        seq = rng.randint(1, 16)
        stop_after = rng.choice([None, None, None, 0, 1, 3])  # interrupt after this layer
        inside = not between or rng.random() < 0.5  # raise inside the layer, not after it
        x = torch.randn(seq, WIDTHS[0])
        before = synchronizer.stats.bytes_offloaded if api else 0
        try:
            h = x
            for index, layer in enumerate(layers):
                if ctx is not None:
                    with ctx:
                        h = layer(h)
                        if inside and index == stop_after:
                            raise Interrupted
                    h = sync_fn(h)
                else:
                    h = layer(h)
                    if inside and index == stop_after:
                        raise Interrupted
                if index == stop_after:
                    raise Interrupted
        except Interrupted:
            interrupted = True
            continue
        optimizer.zero_grad()
        h.square().mean().backward()
        optimizer.step()
        if api:
            offloaded = synchronizer.stats.bytes_offloaded - before
            observed.append((sum(layer_bytes(i, seq) for i in range(K)), offloaded))
            after_interruption.append(interrupted)
        interrupted = False
    if handle is not None:
        handle.remove()
    return [p.detach().clone() for p in layers.parameters()], observed, after_interruption


@pytest.mark.parametrize(
    "api, between",
    [("layers", True), ("context", False)],
    ids=["offload_layers-inside-and-between", "context-inside"],
)
def test_interrupted_training_stays_in_step(api, between):
    expected, _, _ = train(None, between)
    actual, observed, _ = train(api, between)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert len(observed) > 50  # about half the steps finish
    assert all(want == got for want, got in observed), [o for o in observed if o[0] != o[1]][:5]


def test_context_api_interrupted_between_layers_keeps_every_step_in_step():
    """A forward left between two layers (its output dropped) is not continued by the
    next step: every finished step moves exactly the bytes a fresh context would."""
    expected, _, _ = train(None, between=True)
    actual, observed, after_interruption = train("context", between=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert any(after_interruption)  # steps right after an interruption are among them
    assert all(want == got for want, got in observed), [o for o in observed if o[0] != o[1]][:5]
