"""cpu_offload.integrations.megatron on a real Megatron-Core GPTModel (CPU, world size 1)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import load_example
from hosts import require

from cpu_offload.integrations import megatron as megatron_offload

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def megatron():
    """Megatron-Core initialised in this process (gloo, world size 1), torn down after."""
    require("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    example = load_example("megatron_gpt")
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        device = example.initialize(patch.setattr)
        yield example, device
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


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


def _saved_bytes_per_layer(model, data) -> list[int]:
    """Bytes of the non-parameter storages each decoder layer saves for backward."""
    seen: list[dict[int, int]] = []

    def pack(tensor):
        weight = isinstance(tensor, torch.nn.Parameter) or isinstance(
            tensor._base, torch.nn.Parameter
        )
        if not weight:
            storage = tensor.untyped_storage()
            seen[-1][storage.data_ptr()] = storage.nbytes()
        return tensor

    hooks = []
    for layer in model.decoder.layers:

        def pre(module, args, kwargs):
            seen.append({})
            module._census = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            module._census.__enter__()

        def post(module, args, kwargs, output):
            module._census.__exit__(None, None, None)

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(post, with_kwargs=True))
    tokens, positions, mask = data[0]
    model(tokens, positions, mask, labels=tokens).float().mean().backward()
    for hook in hooks:
        hook.remove()
    return [sum(layer.values()) for layer in seen]


def test_gpt_model_trains_bit_identical_and_moves_most_saved_bytes(megatron):
    example, device = megatron
    data = example.batches(device, 2)
    plain = example.build(None, device)
    saved = _saved_bytes_per_layer(plain, data)
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
