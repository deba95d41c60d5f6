"""Issue 39, item 6: on-demand reloads as docs/usage.md says.  A chunk of a whole-forward
context that backward needs before its reload is reloaded silently, counted in
``stats.on_demand_reloads`` and the report; a layer of the layer API (the context API,
``offload_layers``) warns once per context, naming the layer, why, and what to do."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.integrations.torchtune import OffloadActivations

streams = pytest.mark.usefixtures("streams")

#: the layer named, and why (forward passes are numbered across contexts)
NEEDED = re.compile(
    r"cpu_offload: layer 0 of forward pass \d+ was needed by backward before its reload was "
    r"scheduled; it is reloaded now, without overlap with compute\. "
)
ONCE = "This warning is shown once."


def recorded(run: Callable[[], Any]) -> list[warnings.WarningMessage]:
    """The warnings ``run`` gives, each one, none filtered."""
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        run()
    return [w for w in found if str(w.message).startswith("cpu_offload")]


class SkipModel(nn.Module):
    """A residual around a stack: the input is saved by the first Linear (the first
    chunk) and again by the last op of the forward, so backward needs the first chunk
    before it reaches the chunk after it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))
        self.skip = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.body(x) + self.skip(x)).square().mean()


@streams
def test_a_default_whole_forward_reloads_a_chunk_on_demand_silently_and_counts_it():
    torch.manual_seed(0)
    model = SkipModel()
    ctx = OffloadActivations()  # torchtune's defaults

    def steps() -> None:
        for _ in range(2):
            with ctx:
                loss = model(torch.randn(128, 256, requires_grad=True))
            loss.backward()

    assert recorded(steps) == []
    stats = ctx.offload_synchronizer.stats
    assert stats.on_demand_reloads == 2 and stats.tensors_offloaded > 0  # once per step
    report = ctx.report()
    assert [row.index for row in report.rows if row.on_demand] == [0]
    assert "reloaded on demand" in str(report)


class Layer(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(64, 64), nn.GELU())


@streams
def test_the_context_api_warns_once_naming_the_layer_reloaded_on_demand():
    torch.manual_seed(0)
    layers = [Layer() for _ in range(4)]
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)

    def steps() -> None:
        for _ in range(2):
            h = torch.randn(8, 64, requires_grad=True)
            for index, layer in enumerate(layers):
                with ctx:
                    h = layer(h)
                if index != 1:  # layer 1's output skips the sync function: nothing prefetches 0
                    h = sync_fn(h)
            h.sum().backward()

    found = recorded(steps)
    assert len(found) == 1 and found[0].category is UserWarning
    text = str(found[0].message)
    assert NEEDED.match(text)
    assert "Call the sync function on every layer's output to prefetch it." in text
    assert text.endswith(ONCE)
    assert ctx.offload_synchronizer.stats.on_demand_reloads == 2  # both steps, one warning


class Branch(nn.Module):
    """Layer 1 runs on layer 0's output, but the loss does not use its output: backward
    never reaches layer 1, which is where layer 0's reload would start."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.layers[0](x)
        self.layers[1](h0)
        return self.layers[3](self.layers[2](h0)).sum()


@streams
def test_offload_layers_warns_once_naming_the_layer_and_why_and_computes_the_same():
    torch.manual_seed(0)
    model, plain = Branch(), Branch()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 64)
    expected = []
    for _ in range(2):
        plain(x.clone().requires_grad_()).backward()
        expected = [None if p.grad is None else p.grad.clone() for p in plain.parameters()]
    handle = offload_layers(model, 2, min_offload_numel=0)

    def steps() -> None:
        for _ in range(2):
            model(x.clone().requires_grad_()).backward()

    found = recorded(steps)
    assert len(found) == 1 and found[0].category is UserWarning
    text = str(found[0].message)
    assert NEEDED.match(text)
    assert (
        "offload_layers starts a layer's reload when backward reaches the output of a later "
        "layer, and backward reached this one first: a later layer's output does not lead to "
        "the loss (a branch, an early exit)" in text
    )
    assert "Call the sync function" not in text  # its hooks call it: no advice to call it
    assert text.endswith(ONCE)
    assert handle.offload_synchronizer.stats.on_demand_reloads == 2
    assert handle.report().rows[0].on_demand
    for got, want in zip(model.parameters(), expected):  # layer 1's: None in both
        assert (got.grad is None and want is None) or torch.equal(got.grad, want)
    assert sum(want is not None for want in expected) == 6
    handle.remove()
