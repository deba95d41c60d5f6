"""The compiled-layer tests' model: a decoder of blocks in a ModuleDict or ModuleList,
its blocks compiled in place or wrapped, and a training step."""

from __future__ import annotations

import torch
from helpers import MLPBlock
from torch import nn

L, K, WIDTH = 3, 2, 16


class Decoder(nn.Module):
    """Layers in a ModuleDict keyed "0".."L-1" (torchtitan) or a ModuleList."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(WIDTH, WIDTH)
        blocks = [MLPBlock(WIDTH) for _ in range(L)]
        if container == "dict":
            self.layers: nn.Module = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        else:
            self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, 1)

    def blocks(self) -> list[nn.Module]:
        layers = self.layers
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks():
            h = block(h)
        return self.head(h)


def compile_blocks(model: Decoder, style: str, backend: str) -> None:
    """``in place``: block.compile(fullgraph=True), as torchtitan's apply_compile;
    ``wrapped``: torch.compile(block, fullgraph=True) registered in the block's place."""
    names = list(model.layers._modules)
    for name in names:
        block = model.layers._modules[name]
        if style == "in place":
            block.compile(backend=backend, fullgraph=True)
        else:
            model.layers.register_module(
                name, torch.compile(block, backend=backend, fullgraph=True)
            )


def step(model: nn.Module, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]
