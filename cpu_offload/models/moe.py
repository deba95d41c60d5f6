"""A Mixtral-style decoder layer: Llama's attention, a mixture of experts as its MLP.

The experts run as Megatron-Core's grouped experts do: each expert's tokens gathered
into one block, one batched matmul for all experts' ``linear_fc1`` (gate and up), the
SwiGLU ``act_fn``, one for ``linear_fc2``, the outputs weighted and added back to their
tokens.  The submodules carry Megatron-Core's names (``mlp.experts.linear_fc1``,
``mlp.experts.act_fn``), so ``modules=`` finds ``expert_fc1`` and ``moe_act`` in it.

NOTE [Balanced routing]
A real router sends each token to the ``top_k`` experts its logits rank highest: which
ones, and so how many tokens each expert gets, depends on the data, and on the meta
device (the planner's census) there is none.  Here the router's logits and softmax are
computed (their FLOPs and saved bytes count), but the experts are fixed: token ``t``
goes to experts ``t, t + 1, ..., t + top_k - 1`` (mod ``experts``), weighted by its
router probabilities for them, renormalized.  Every expert gets exactly
``tokens * top_k / experts`` tokens: the census measures a perfectly balanced MoE,
the case load-balancing losses aim at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .llama import LlamaConfig, LlamaLayer

__all__ = ["GroupedLinear", "MoeConfig", "MoeLayer", "balanced_experts"]


@dataclass
class MoeConfig(LlamaConfig):
    experts: int = 8
    top_k: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"MoeConfig: top_k ({self.top_k}) must be in 1..experts ({self.experts})."
            )


def balanced_experts(tokens: int, experts: int, top_k: int, device: torch.device) -> torch.Tensor:
    """``(tokens, top_k)``: the experts of each token (NOTE [Balanced routing])."""
    if tokens * top_k % experts:
        raise ValueError(
            f"MoeLayer: balanced routing needs tokens * top_k ({tokens} * {top_k}) to be a "
            f"multiple of experts ({experts}); change the batch or the sequence length."
        )
    first = torch.arange(tokens, device=device)[:, None]
    return (first + torch.arange(top_k, device=device)[None, :]) % experts


class GroupedLinear(nn.Module):
    """One weight ``(in, out)`` per expert, applied to ``(experts, tokens, in)`` at once."""

    def __init__(self, experts: int, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, inputs, outputs) * inputs**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.weight)


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class Experts(nn.Module):
    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.linear_fc1 = GroupedLinear(config.experts, config.hidden, 2 * config.ffn)
        self.act_fn = SwiGLU()
        self.linear_fc2 = GroupedLinear(config.experts, config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class MoeMlp(nn.Module):
    """The router and the experts (NOTE [Balanced routing])."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden, config.experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self.config
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        chosen = balanced_experts(len(tokens), config.experts, config.top_k, x.device)
        weights = probs.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        order = chosen.flatten().argsort(stable=True)  # slots grouped by expert
        slots = order // config.top_k  # the token of each slot
        grouped = tokens.index_select(0, slots).view(config.experts, -1, tokens.shape[-1])
        out = self.experts(grouped).flatten(0, 1)
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(tokens).index_add(0, slots, out).view_as(x)


class MoeLayer(LlamaLayer):
    """One decoder layer whose MLP is a mixture of experts (``mlp``)."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__(config)
        del self.gate, self.up, self.down
        self.mlp = MoeMlp(config)

    def feed_forward(self, normed: torch.Tensor) -> torch.Tensor:
        return self.mlp(normed)  # type: ignore[no-any-return]
