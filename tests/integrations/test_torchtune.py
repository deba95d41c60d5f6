"""A real torchtune Llama 3: the drop-in for get_act_offloading_ctx_manager, the order with
set_activation_checkpointing, and the recipe's order with compile_model."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from hosts import require

from cpu_offload.integrations.torchtune import get_act_offloading_ctx_manager

torchtune = require("torchtune")
from torchtune import modules, training  # noqa: E402
from torchtune.models.llama3 import llama3  # noqa: E402

LAYERS = 4


def build():
    torch.manual_seed(0)
    return llama3(
        vocab_size=256,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        max_seq_len=64,
        intermediate_dim=128,
    )


def checkpointed(model):
    training.set_activation_checkpointing(
        model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
    )
    return model


def step(model, ctx=None):
    """A recipe's step: the forward inside the context, the backward outside."""
    ctx = ctx if ctx is not None else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (2, 32))
    with ctx:
        logits = model(tokens)
    logits.float().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_drop_in_offloads_inside_its_context_only():
    expected = step(build())
    model = build()
    ctx = get_act_offloading_ctx_manager(model, True, num_offloaded_layers=2, min_offload_numel=0)
    stats = ctx.handle.offload_synchronizer.stats
    assert same(step(model), expected) and stats.forward_passes == 0  # outside: untouched
    assert same(step(model, ctx), expected) and stats.tensors_offloaded > 10
    assert stats.tensors_reloaded == stats.tensors_offloaded
    ctx.remove()
    assert all(not layer._forward_pre_hooks for layer in model.layers)


def test_the_drop_in_offloads_all_layers_but_the_last_by_default():
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning that copies cannot overlap
        ctx = get_act_offloading_ctx_manager(model, True)
    assert ctx.handle.offload_synchronizer.num_offloaded_layers == LAYERS - 1
    ctx.remove()


def test_the_drop_in_takes_a_memory_budget(capsys):
    expected = step(build())
    model = build()
    ctx = get_act_offloading_ctx_manager(model, True, memory_budget="700KiB", min_offload_numel=0)
    stats = ctx.handle.offload_synchronizer.stats
    assert same(step(model), expected) and stats.forward_passes == 0  # outside: untouched
    assert same(step(model, ctx), expected) and ctx.handle.plan is None  # measured
    moved = []
    for _ in range(2):
        before = stats.bytes_offloaded
        assert same(step(model, ctx), expected)
        moved.append(stats.bytes_offloaded - before)
    plan = ctx.handle.plan
    assert plan.fits and plan.policy != ["keep"] * LAYERS
    assert moved == [plan.predicted.offloaded_bytes] * 2
    assert "get_act_offloading" not in capsys.readouterr().out  # offload_layers says it
    ctx.remove()
    with pytest.raises(TypeError, match="pass either num_offloaded_layers .k. or memory_budget"):
        get_act_offloading_ctx_manager(model, True, 2, memory_budget="1GiB")


def test_disabled_is_a_null_context():
    assert isinstance(get_act_offloading_ctx_manager(build(), False), contextlib.nullcontext)


def test_checkpointing_first_then_offload_moves_the_checkpoint_inputs():
    expected = step(checkpointed(build()))
    model = checkpointed(build())
    ctx = get_act_offloading_ctx_manager(model, True, num_offloaded_layers=2, min_offload_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert same(step(model, ctx), expected)
    assert ctx.handle.offload_synchronizer.stats.tensors_offloaded == 2  # one input per layer
    ctx.remove()


def test_offload_first_then_checkpointing_warns_with_the_order_to_use():
    expected = step(checkpointed(build()))
    model = build()
    ctx = get_act_offloading_ctx_manager(model, True, num_offloaded_layers=2, min_offload_numel=0)
    checkpointed(model)
    with pytest.warns(UserWarning, match="Wrap the layers for checkpointing first"):
        assert same(step(model, ctx), expected)
    assert ctx.handle.offload_synchronizer.stats.tensors_offloaded == 0
    ctx.remove()


def test_the_recipe_order_with_compile_model(monkeypatch):
    """torchtune's recipes: checkpointing, compile_model, then the offloading context."""
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    reference = checkpointed(build())
    training.compile_model(reference, verbose=False)
    expected = step(reference)
    model = checkpointed(build())
    training.compile_model(model, verbose=False)
    ctx = get_act_offloading_ctx_manager(model, True, num_offloaded_layers=2, min_offload_numel=0)
    for _ in range(2):
        assert same(step(model, ctx), expected)
    assert ctx.handle.offload_synchronizer.stats.tensors_offloaded == 4
    ctx.remove()
