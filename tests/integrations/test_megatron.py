"""cpu_offload.integrations.megatron on a real Megatron-Core GPTModel (CPU, world size 1)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import saved_bytes_per_layer
from hosts import require

from cpu_offload.integrations import megatron as megatron_offload

ROOT = Path(__file__).resolve().parents[2]


def test_the_wrapper_takes_megatrons_seven_positionals():
    # enabled, num_layers, model_layers, activations, weights, double buffering, retain
    result = megatron_offload.get_cpu_offload_context(True, 1, 4, True, False, False, True)
    assert len(result) == 2  # the core function would read the 7th as manual mode
    context, commit = result
    assert context.offload_synchronizer.host_buffers.retain
    assert commit(3) == 3


def test_without_the_patch_megatron_refuses_offloading(megatron):
    example, device = megatron
    with pytest.raises(AssertionError, match="CPU Offloading is enabled when TE is not present"):
        example.build(2, device)


def test_patch_installs_and_remove_restores(megatron):
    import megatron.core.transformer.transformer_block as block

    before = block.get_cpu_offload_context
    with megatron_offload.patch(min_offload_numel=0) as handle:
        assert block.get_cpu_offload_context is handle.function
    assert block.get_cpu_offload_context is before


@pytest.mark.parametrize("order", ["first-in-first-out", "last-in-first-out"])
def test_two_patches_removed_in_any_order_restore_megatron(megatron, order):
    import megatron.core.extensions.transformer_engine as extension
    import megatron.core.transformer.transformer_block as block

    before = (block.get_cpu_offload_context, extension.get_cpu_offload_context)
    first = megatron_offload.patch()
    second = megatron_offload.patch(min_offload_numel=0)
    assert block.get_cpu_offload_context is second.function
    if order == "first-in-first-out":
        first.remove()
        assert block.get_cpu_offload_context is second.function  # the latest stays
        second.remove()
    else:
        second.remove()
        assert block.get_cpu_offload_context is first.function
        first.remove()
    assert (block.get_cpu_offload_context, extension.get_cpu_offload_context) == before
    first.remove()  # removing twice changes nothing
    assert block.get_cpu_offload_context is before[0]


def test_gpt_model_trains_bit_identical_and_moves_most_saved_bytes(megatron):
    example, device = megatron
    data = example.batches(device, 2)
    plain = example.build(None, device)
    saved = saved_bytes_per_layer(plain, data)
    expected = example.train(example.build(None, device), data)
    with megatron_offload.patch(min_offload_numel=0):
        model = example.build(example.OFFLOADED, device)
    inside = []
    model.decoder.layers[0].register_forward_pre_hook(
        lambda module, args: inside.append(model.config._cpu_offloading_context.inside_context)
    )
    actual = example.train(model, data)
    for step_expected, step_actual in zip(expected, actual):
        assert all(torch.equal(a, b) for a, b in zip(step_expected, step_actual))
    stats = model.decoder.offload_context.offload_synchronizer.stats
    per_layer = stats.bytes_offloaded / (len(data) * example.OFFLOADED)
    assert stats.tensors_offloaded > 0 and stats.on_demand_reloads == 0
    # Most of a layer's saved bytes move: all of them here (66% before views of the
    # fused qkv and SwiGLU outputs moved through their base).
    assert per_layer >= 0.9 * saved[0], (per_layer, saved)
    # Without TransformerEngine, Megatron's linear layers must not see inside_context
    # (they would assert that TE is installed); the context itself knows it is inside.
    assert inside == [False, False]


def test_gpt_model_trains_bit_identical_under_a_memory_budget(megatron, capsys):
    example, device = megatron
    data = example.batches(device, 3)
    expected = example.train(example.build(None, device), data)
    with megatron_offload.patch(min_offload_numel=0, memory_budget="1MiB"):
        model = example.build(example.OFFLOADED, device)
    synchronizer = model.decoder.offload_context.offload_synchronizer
    moved = []
    original = synchronizer.listener.step_starts

    def step_starts():  # the bytes moved by the step that ended
        moved.append(synchronizer.stats.bytes_offloaded)
        original()

    synchronizer.listener.step_starts = step_starts
    actual = example.train(model, data)
    for step_expected, step_actual in zip(expected, actual):
        assert all(torch.equal(a, b) for a, b in zip(step_expected, step_actual))
    plan = synchronizer.plan
    assert "offload" in plan.policy and not set(plan.policy) - {"keep", "offload"}
    assert plan.checkpoint_refused == [
        "layers 0-3: no module to checkpoint: the layers run in the host library's own loop"
    ]
    total = synchronizer.stats.bytes_offloaded
    assert moved[:2] == [0, 0] and total - moved[2] == plan.predicted.offloaded_bytes
    assert "cpu_offload.integrations.megatron(memory_budget=1.00 MiB)" in capsys.readouterr().out


def test_example_runs():
    require("megatron.core")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "megatron_gpt.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gradients bit-identical: True" in result.stdout


def test_offload_layers_finds_megatrons_decoder_layers(megatron):
    """The way past Megatron's config checks (pipeline parallelism, recompute)."""
    from cpu_offload import offload_layers

    example, device = megatron
    data = example.batches(device, 2)
    expected = example.train(example.build(None, device), data)
    model = example.build(None, device)
    handle = offload_layers(model, 0.5, min_offload_numel=0)
    synchronizer = handle.offload_synchronizer
    assert (synchronizer.num_layers, synchronizer.num_offloaded_layers) == (4, 2)
    actual = example.train(model, data)
    handle.remove()
    for step_expected, step_actual in zip(expected, actual):
        assert all(torch.equal(a, b) for a, b in zip(step_expected, step_actual))
    assert synchronizer.stats.tensors_offloaded > 0


def no_cuda_rng(monkeypatch) -> None:
    """Megatron's checkpoint keeps the CUDA RNG states beside the CPU's: none on a CPU."""
    import types

    from megatron.core.tensor_parallel import random

    tracker = types.SimpleNamespace(get_states=dict, set_states=lambda states: None)
    monkeypatch.setattr(random, "get_cuda_rng_tracker", lambda *args, **kwargs: tracker)
    monkeypatch.setattr(random, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    monkeypatch.setattr(random, "_set_cuda_rng_state", lambda *args, **kwargs: None)


@pytest.mark.parametrize("layers_per_chunk", [1, 2])
def test_full_recompute_under_a_memory_budget(megatron, monkeypatch, layers_per_chunk):
    """memory_budget= counts each chunk's saved inputs on its last layer and its
    recompute at its backward (NOTE [A budget around reentrant checkpoints]); a budget a
    byte under keeping everything offloads a chunk's inputs, never checkpoints a layer
    again, and the steps stay bit-identical."""
    from cpu_offload import offload_layers

    example, device = megatron
    no_cuda_rng(monkeypatch)
    data = example.batches(device, 3)
    expected = example.train(recomputed_gpt(layers_per_chunk).to(device), data)
    plans = []
    for budget in ("1GiB", None):
        model = recomputed_gpt(layers_per_chunk).to(device)
        budget = budget or f"{plans[0].predicted.peak_bytes - 1}B"
        handle = offload_layers(model, memory_budget=budget, min_offload_numel=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actual = example.train(model, data)
        assert not [w for w in caught if str(w.message).startswith("cpu_offload")]
        for step_expected, step_actual in zip(expected, actual):
            assert all(torch.equal(a, b) for a, b in zip(step_expected, step_actual))
        plans.append(handle.plan)
        measured, stats = handle.auto.measured, handle.offload_synchronizer.stats
        handle.remove()
    last = [j for j in range(4) if (j + 1) % layers_per_chunk == 0]
    hidden_state = 32 * 2 * 64 * 4  # [seq, batch, hidden] fp32
    assert all(r.in_checkpoint for r in measured)
    assert all((r.saved_bytes >= hidden_state) == (j in last) for j, r in enumerate(measured))
    assert all((r.recompute_bytes > hidden_state) == (j in last) for j, r in enumerate(measured))
    keep, planned = plans
    assert keep.policy == ["keep"] * 4
    assert planned.fits and "offload" in planned.policy
    assert not any(c.startswith("checkpoint") for c in planned.policy)
    assert stats.bytes_offloaded >= hidden_state and stats.on_demand_reloads == 0
    assert stats.bytes_reloaded == stats.bytes_offloaded


def recomputed_gpt(layers_per_chunk: int) -> torch.nn.Module:
    """The example's GPTModel under ``recompute_granularity="full"`` (Megatron's reentrant
    ``tensor_parallel.checkpoint`` around chunks of ``layers_per_chunk`` layers)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=layers_per_chunk,
    )
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
        position_embedding_type="rope",
    )


@pytest.mark.parametrize("layers_per_chunk", [1, 2])
def test_full_recompute_moves_the_checkpoints_inputs(megatron, monkeypatch, layers_per_chunk):
    """Megatron's own cpu_offloading refuses full recompute; offload_layers moves what it
    keeps: the hidden state each recomputed chunk saves (NOTE [Layers inside a reentrant
    checkpoint])."""
    import types

    from megatron.core.tensor_parallel import random

    from cpu_offload import offload_layers

    example, device = megatron
    # Megatron's checkpoint keeps the CUDA RNG states beside the CPU's: none on a CPU
    tracker = types.SimpleNamespace(get_states=dict, set_states=lambda states: None)
    monkeypatch.setattr(random, "get_cuda_rng_tracker", lambda *args, **kwargs: tracker)
    monkeypatch.setattr(random, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    monkeypatch.setattr(random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    data = example.batches(device, 2)
    expected = example.train(recomputed_gpt(layers_per_chunk).to(device), data)
    model = recomputed_gpt(layers_per_chunk).to(device)
    handle = offload_layers(model, 2, min_offload_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = example.train(model, data)
    # chunks [0], [1] or [0, 1] offloaded: no input stays behind, nothing to say
    assert not [w for w in caught if str(w.message).startswith("cpu_offload")]
    for step_expected, step_actual in zip(expected, actual):
        assert all(torch.equal(a, b) for a, b in zip(step_expected, step_actual))
    stats = handle.offload_synchronizer.stats
    hidden_state = 32 * 2 * 64 * 4  # [seq, batch, hidden] fp32, one per offloaded chunk
    chunks = 2 // layers_per_chunk
    assert stats.bytes_offloaded >= 2 * chunks * hidden_state
    assert stats.bytes_reloaded == stats.bytes_offloaded and stats.on_demand_reloads == 0
    handle.remove()


def test_the_wrapper_and_the_patch_pass_cuda_graph_on(megatron):
    context, _ = megatron_offload.get_cpu_offload_context(
        True, 1, 4, True, False, False, False, cuda_graph="layer"
    )
    assert context.offload_synchronizer.cuda_graph == "layer"
    assert context.offload_synchronizer.host_buffers.retain  # fixed buffers for the graphs
    example, device = megatron
    data = example.batches(device, 2)
    expected = example.train(example.build(None, device), data)
    with megatron_offload.patch(min_offload_numel=0, cuda_graph=True):
        model = example.build(example.OFFLOADED, device)
    actual = example.train(model, data)  # no capture: the steps run as eager (warm-up)
    for step_expected, step_actual in zip(expected, actual):
        assert all(torch.equal(a, b) for a, b in zip(step_expected, step_actual))
    synchronizer = model.decoder.offload_context.offload_synchronizer
    assert synchronizer.cuda_graph == "step" and synchronizer.stats.tensors_offloaded > 0
    assert synchronizer.report().to_dict()["cuda_graph/warmup_steps"] == len(data)
