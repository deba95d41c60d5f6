"""torchtitan 0.3.0 as a real host (issue 50): its Llama3 debug model built with its own
model args, its activation-checkpointing configs and its ``apply_compile``
(``block.compile(fullgraph=True)`` per block), with ``offload_layers(model, k)`` before or
after compiling.  On CPU: SDPA attention (FlexAttention has no CPU backward), torch on
one thread; each run is bit-identical to the same program without offload."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from helpers import offload_in_order
from hosts import require

K = 3


def debug_model() -> torch.nn.Module:
    """torchtitan's Llama3 "debugmodel" (6 blocks, dim 256, in a ModuleDict) with SDPA."""
    require("torchtitan")
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def parallelize(model: torch.nn.Module, ac: str, backend: str) -> None:
    """What torchtitan's parallelize_llama does on one CPU rank: AC, then apply_compile."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.compile import apply_compile

    if ac == "full":
        FullAC(FullAC.Config()).apply(model)
    elif ac == "selective":
        SelectiveAC(SelectiveAC.Config()).apply(model)
    apply_compile(
        model,
        compile_config=CompileConfig(enable=True, backend=backend),
        parallel_dims=types.SimpleNamespace(tp_enabled=False),  # one rank, no TP
    )


def step(model: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
    ).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "ac, order, backend",
    [
        ("none", "offload first", "aot_eager"),
        ("full", "compile first", "aot_eager"),
        ("selective", "offload first", "aot_eager"),
        ("none", "compile first", "inductor"),
    ],
)
def test_torchtitan_llama3_per_block_compile_offloaded(ac, order, backend):
    reference = debug_model()
    model = copy.deepcopy(reference)
    parallelize(reference, ac, backend)
    expected = [step(reference, seed) for seed in (1, 2)]
    handle = offload_in_order(model, order, lambda m: parallelize(m, ac, backend), K)
    assert (
        "6 " in handle.found and "layers 0-5 are keys '0'..'5' in iteration order" in handle.found
    )
    actual = [step(model, seed) for seed in (1, 2)]
    assert len(expected[0]) == len(actual[0]) == sum(1 for _ in model.parameters())
    for want, got in zip(expected, actual):
        for a, b in zip(want, got):
            assert torch.equal(a, b)
    stats = handle.offload_synchronizer.stats
    assert stats.forward_passes == 2 and stats.bytes_offloaded > 0
    handle.remove()
