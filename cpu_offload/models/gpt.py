"""A small GPT-style decoder used by the demo (``python -m cpu_offload``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..hooks.marking import start_offload

__all__ = ["GPT", "Block", "GPTConfig"]


@dataclass
class GPTConfig:
    vocab: int = 1024
    hidden: int = 256
    heads: int = 4
    layers: int = 4
    seq: int = 128


class Block(nn.Module):
    """Pre-norm decoder layer: causal self-attention and a GELU MLP, on ``(b, s, hidden)``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        # q, k and v are views of one qkv tensor: copy it once and rebuild the views.
        start_offload(q, k, v, offload_base_tensor=True)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Embedding, ``layers`` decoder blocks, final norm and LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Parameter(torch.zeros(config.seq, config.hidden))
        self.blocks = nn.ModuleList(
            Block(config.hidden, config.heads) for _ in range(config.layers)
        )
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        context: Any = None,
        sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits; with ``context`` and ``sync_fn`` each block runs under the offloader."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            if context is None:
                x = block(x)
            else:
                with context:
                    x = block(x)
                x = sync_fn(x) if sync_fn is not None else x
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        logits = self(tokens[:, :-1], **kwargs)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
