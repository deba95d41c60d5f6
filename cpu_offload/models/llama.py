"""A Llama-style decoder in plain PyTorch (used by the benchmark and the tests).

RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention`` and a SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..hooks.marking import start_offload

__all__ = ["Llama", "LlamaConfig", "LlamaLayer"]


@dataclass
class LlamaConfig:
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 688
    layers: int = 4
    vocab: int = 1024
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: hidden ({self.hidden}) must be divisible by heads "
                f"({self.heads}) and heads by kv_heads ({self.kv_heads})."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary(seq: int, dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Angles ``(seq, dim / 2)`` of rotary position embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    return torch.outer(torch.arange(seq, device=device).float(), inv_freq)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (batch, heads, seq, head_dim) by ``angles``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class LlamaLayer(nn.Module):
    """One decoder layer; returns the new hidden states."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        head_dim = config.head_dim
        self.attn_norm = RMSNorm(config.hidden)
        self.q = nn.Linear(config.hidden, config.heads * head_dim, bias=False)
        self.k = nn.Linear(config.hidden, config.kv_heads * head_dim, bias=False)
        self.v = nn.Linear(config.hidden, config.kv_heads * head_dim, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)
        self.mlp_norm = RMSNorm(config.hidden)
        self.gate_up = nn.Linear(config.hidden, 2 * config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.feed_forward(self.mlp_norm(x))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The attention block, its residual added."""
        config = self.config
        batch, seq, hidden = x.shape
        head_dim = config.head_dim
        normed = self.attn_norm(x)
        # Separate projections: v is a pure re-stride of its own output, offloaded whole.
        q, k, v = (
            proj(normed).view(batch, seq, -1, head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        angles = rotary(seq, head_dim, config.rope_theta, x.device)
        q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.out(attention.transpose(1, 2).reshape(batch, seq, hidden))

    def feed_forward(self, normed: torch.Tensor) -> torch.Tensor:
        """The MLP (SwiGLU) of the normalized hidden states."""
        gate, up = self.gate_up(normed).chunk(2, dim=-1)
        start_offload(gate, up, offload_base_tensor=True)  # one copy of the fused output
        return self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy decoding without a cache (each step reruns the whole sequence)."""
        for _ in range(steps):
            next_token = self(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens
