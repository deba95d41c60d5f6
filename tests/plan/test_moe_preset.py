"""The planner's mixture-of-experts layer and presets (models/moe.py, presets.py):
balanced routing, what it computes, and the bytes a run moves."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_offload import offload_layers
from cpu_offload.models.moe import MoeConfig, MoeLayer, balanced_experts
from cpu_offload.plan import measure_layer
from cpu_offload.plan.layers import preset_layer
from cpu_offload.plan.module_census import costs_by

SMALL = dict(hidden=32, heads=4, kv_heads=2, ffn=48, experts=4, top_k=2)


def test_the_layer_computes_each_tokens_two_experts():
    """The grouped experts equal a loop over tokens: each token's experts t, t + 1
    (mod experts), weighted by its router probabilities for them, renormalized."""
    torch.manual_seed(0)
    layer = MoeLayer(MoeConfig(**SMALL))
    normed = torch.randn(2, 8, 32)
    mlp, tokens = layer.mlp, normed.reshape(-1, 32)
    probs = torch.softmax(mlp.router(tokens), dim=-1)
    expected = torch.zeros_like(tokens)
    for t, token in enumerate(tokens):
        chosen = [t % 4, (t + 1) % 4]
        weights = probs[t, chosen] / probs[t, chosen].sum()
        for expert, weight in zip(chosen, weights):
            gate, up = (token @ mlp.experts.linear_fc1.weight[expert]).chunk(2)
            expected[t] += weight * ((F.silu(gate) * up) @ mlp.experts.linear_fc2.weight[expert])
    torch.testing.assert_close(mlp(normed).reshape(-1, 32), expected)


def test_routing_is_balanced_or_refused():
    chosen = balanced_experts(12, 4, 2, torch.device("cpu"))
    assert torch.equal(chosen.flatten().bincount(), torch.full((4,), 6))
    with pytest.raises(ValueError, match=r"MoeLayer: balanced routing needs tokens \* top_k"):
        balanced_experts(5, 4, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"MoeConfig: top_k \(3\) must be in 1..experts \(2\)"):
        MoeConfig(**{**SMALL, "experts": 2, "top_k": 3})


def test_the_mixtral_preset_counts_a_balanced_moe():
    """Mixtral-8x7B shapes on the meta device: every expert's matmuls run on
    tokens * 2 / 8 tokens, so the experts' FLOPs are those of 2 * tokens."""
    spec = preset_layer("mixtral8x7b-layer", seq=256)
    assert "8 experts top 2 (balanced)" in spec.description and spec.num_layers == 32
    layer = measure_layer(spec.make_layer, spec.inputs)
    parts = costs_by(layer, "module")
    slots = 256 * 2
    assert parts["mlp.experts.linear_fc1"].forward_flops == 2 * slots * 4096 * 2 * 14336
    assert parts["mlp.experts.linear_fc2"].forward_flops == 2 * slots * 14336 * 4096
    # the fc1 output (gate and up, one storage) and silu(gate), in bf16
    assert parts["mlp.experts.act_fn"].saved_bytes == (2 + 1) * slots * 14336 * 2
    assert parts["mlp.router"].forward_flops == 2 * 256 * 4096 * 8


@pytest.mark.parametrize("modules", [None, ["expert_fc1", "moe_act"], {"attn_norm": "keep"}])
def test_a_run_moves_what_the_census_predicts(modules):
    """A stack of the small MoE layer, offloaded on the CPU, moves the census's bytes."""
    config = MoeConfig(**SMALL)
    x = torch.empty(2, 16, 32, device="meta")
    layer = measure_layer(
        lambda: MoeLayer(config), x, min_offload_numel=0, attention="cpu", modules=modules
    )
    torch.manual_seed(0)
    model = nn.Sequential(*(MoeLayer(config) for _ in range(3)))
    handle = offload_layers(list(model), 2, min_offload_numel=0, modules=modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(2, 16, 32, requires_grad=True)).sum().backward()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    assert layer.offloaded_bytes > 0
    assert (stats.bytes_offloaded, stats.tensors_offloaded) == (
        2 * layer.offloaded_bytes,
        2 * layer.tensors_offloaded,
    )
