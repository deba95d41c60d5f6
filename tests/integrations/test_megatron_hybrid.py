"""cpu_offload on a real Megatron-Core 0.19 ``HybridModel`` (CPU, gloo, world size 1).

The shared environment pins megatron-core 0.16.1, which has no HybridModel: there these
tests skip.  .ci/run installs megatron-core 0.19.2 into a git-ignored folder and runs this
file (and tests/integrations/test_megatron.py, test_megatron_cuda_graph.py) with it on
``PYTHONPATH``.

The library's own ``hybrid_stack_spec`` is built from TransformerEngine modules, and its
Mamba layers need ``mamba_ssm``: neither is on a CPU.  :func:`local_hybrid_stack_spec`
builds the attention (``*``) and MLP (``-``) layers from the modules of Megatron's own
local GPT spec instead; Mamba (``M``) layers are not built here.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from cuda_graph_steps import assert_replays_eager
from helpers import load_example, saved_bytes_per_layer
from hosts import require
from megatron_graphs import FLAVOUR_IDS, FLAVOURS, expected, model_and_loss, whole_step

from cpu_offload import offload_layers
from cpu_offload.integrations import megatron as megatron_offload

PATTERN = "*-*-"  # attention, MLP, attention, MLP
LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 4, 64, 4, 32, 2, 128
HIDDEN_STATE = SEQ * BATCH * HIDDEN * 4  # one [seq, batch, hidden] fp32 tensor


@pytest.fixture(scope="module")
def megatron():
    """Megatron-Core 0.19 or later initialised in this process, torn down after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        core = require("megatron.core")
    from packaging.version import Version

    if Version(core.__version__) < Version("0.19"):
        pytest.skip(
            f"megatron-core {core.__version__} has no HybridModel; .ci/run runs this file "
            "with megatron-core 0.19.2"
        )
    import torch.distributed as dist
    from megatron.core import parallel_state

    example = load_example("megatron_gpt")
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        device = example.initialize(patch.setattr)  # gloo and Megatron's CPU harness
        yield example, device
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def local_hybrid_stack_spec():
    """A ``HybridStack`` spec of attention and MLP layers made of the modules of
    ``get_gpt_layer_local_submodules()`` (no TransformerEngine), shaped as 0.19.2's
    ``hybrid_stack_spec``: an attention layer is a ``TransformerLayer`` without an MLP, an
    MLP layer an ``MLPLayer`` without attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = get_gpt_layer_local_submodules()
    attention = TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm,
        self_attention=local.self_attention,
        self_attn_bda=local.self_attn_bda,
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def hybrid_model(device: torch.device, **config: object) -> torch.nn.Module:
    """A small HybridModel of :data:`PATTERN`, seeded, on ``device``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings: dict = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
    )
    settings.update(config)
    torch.manual_seed(0)
    # HybridStack's final norm is TENorm whatever the spec says: the local norm here
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hybrid_block, "TENorm", get_gpt_layer_local_submodules().input_layernorm)
        model = HybridModel(
            TransformerConfig(**settings),
            local_hybrid_stack_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern=PATTERN,
            position_embedding_type="rope",
        )
    return model.to(device)


def same(expected: list[list[torch.Tensor]], actual: list[list[torch.Tensor]]) -> bool:
    return len(expected) == len(actual) and all(
        len(e) == len(a) and all(torch.equal(x, y) for x, y in zip(e, a))
        for e, a in zip(expected, actual)
    )


def test_the_local_spec_builds_attention_and_mlp_layers_without_te(megatron):
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    example, device = megatron
    model = hybrid_model(device)
    layers = list(model.decoder.layers)
    assert [type(layer) for layer in layers] == [TransformerLayer, MLPLayer] * 2
    assert all(isinstance(layer.mlp, IdentityOp) for layer in layers[::2])
    assert all(isinstance(layer.self_attention, IdentityOp) for layer in layers[1::2])
    modules = {type(module).__module__ for module in model.modules()}
    assert not [name for name in modules if "transformer_engine" in name], modules


@pytest.mark.parametrize("k", [1, 2, 3])
def test_offload_layers_trains_a_hybrid_model_bit_identical(megatron, k):
    example, device = megatron
    data = example.batches(device, 2)
    saved = saved_bytes_per_layer(hybrid_model(device), data)
    expected = example.train(hybrid_model(device), data)
    model = hybrid_model(device)
    handle = offload_layers(model, k, min_offload_numel=0)
    synchronizer = handle.offload_synchronizer
    assert (synchronizer.num_layers, synchronizer.num_offloaded_layers) == (LAYERS, k)
    assert "decoder.layers" in handle.found, handle.found
    actual = example.train(model, data)
    handle.remove()
    assert same(expected, actual)
    stats = synchronizer.stats
    assert stats.bytes_reloaded == stats.bytes_offloaded and stats.on_demand_reloads == 0
    # what the first k layers (attention and MLP) save moves, step after step
    assert stats.bytes_offloaded / len(data) >= 0.9 * sum(saved[:k]), (stats, saved)


@pytest.mark.parametrize("layers_per_chunk", [1, 2])
def test_full_recompute_moves_the_checkpoints_inputs(megatron, monkeypatch, layers_per_chunk):
    """HybridStack runs ``recompute_granularity="full"`` through the same reentrant
    ``tensor_parallel.checkpoint`` as TransformerBlock (NOTE [Layers inside a reentrant
    checkpoint]): each offloaded chunk's input hidden state moves."""
    from megatron.core.tensor_parallel import random

    example, device = megatron
    # Megatron's checkpoint keeps the CUDA RNG states beside the CPU's: none on a CPU
    tracker = types.SimpleNamespace(get_states=dict, set_states=lambda states: None)
    monkeypatch.setattr(random, "get_cuda_rng_tracker", lambda *args, **kwargs: tracker)
    monkeypatch.setattr(random, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    monkeypatch.setattr(random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    recompute = dict(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=layers_per_chunk,
    )
    data = example.batches(device, 2)
    expected = example.train(hybrid_model(device, **recompute), data)
    model = hybrid_model(device, **recompute)
    handle = offload_layers(model, 2, min_offload_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = example.train(model, data)
    handle.remove()
    assert not [w for w in caught if str(w.message).startswith("cpu_offload")]
    assert same(expected, actual)
    stats = handle.offload_synchronizer.stats
    chunks = 2 // layers_per_chunk  # the offloaded chunks: [0], [1] or [0, 1]
    assert stats.bytes_offloaded >= len(data) * chunks * HIDDEN_STATE, stats
    assert stats.bytes_reloaded == stats.bytes_offloaded and stats.on_demand_reloads == 0


def test_patch_does_nothing_on_a_hybrid_model_and_says_so(megatron, monkeypatch):
    """HybridStack never asks for ``get_cpu_offload_context`` (TransformerBlock does):
    under :func:`~cpu_offload.integrations.megatron.patch`, ``cpu_offloading=True``
    builds, trains as without it, moves nothing, and warns.  ``offload_layers`` is the way."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    example, device = megatron
    calls: list[tuple] = []
    original = megatron_offload.get_cpu_offload_context

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(megatron_offload, "get_cpu_offload_context", counted)
    data = example.batches(device, 2)
    expected = example.train(hybrid_model(device), data)
    offloading = dict(cpu_offloading=True, cpu_offloading_num_layers=2)
    init = HybridStack.__init__
    with megatron_offload.patch(min_offload_numel=0), megatron_offload.patch():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hybrid_model(device)  # without the switch: nothing to say
            model = hybrid_model(device, **offloading)
        ours = [w for w in caught if str(w.message).startswith("cpu_offload")]
        assert [w.category for w in ours] == [UserWarning], [str(w.message) for w in ours]
        assert str(ours[0].message).startswith(
            "cpu_offload: TransformerConfig(cpu_offloading=True) does nothing for a "
            "Megatron-Core HybridModel: its HybridStack never asks for an offload context"
        )
        assert "offload_layers(model, k)" in str(ours[0].message)
        assert calls == [] and not hasattr(model.decoder, "offload_context")
        assert model.config._cpu_offloading_context is None
        actual = example.train(model, data)
        assert same(expected, actual) and calls == []
        # the same patch and config do reach a GPTModel's TransformerBlock
        gpt = GPTModel(
            model.config,
            get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
        )
    assert len(calls) == 1 and calls[0][:3] == (True, 2, LAYERS)  # the block asks once
    assert gpt.decoder.offload_context.offload_synchronizer.num_offloaded_layers == 2
    assert HybridStack.__init__ is init  # both patches removed: Megatron's own again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hybrid_model(device, **offloading)
    assert not [w for w in caught if str(w.message).startswith("cpu_offload")]


@pytest.mark.parametrize("flavour", FLAVOURS, ids=FLAVOUR_IDS)
def test_a_whole_step_of_a_hybrid_model_captured_replays_eager_values_and_bytes(megatron, flavour):
    """0.19's full-iteration graphs (``cuda_graph_impl="full_iteration"``, which
    ``TransformerConfig`` accepts beside offloading) around a HybridModel offloaded by
    ``offload_layers(cuda_graph=True)``: the step captured once on the modeled
    accelerator after an eager warm-up step and replayed per batch computes eager's loss
    and gradients without offload, each replay moving the warm-up step's bytes."""
    example, device = megatron
    data = example.batches(device, 3)
    full_iteration = dict(cuda_graph_impl="full_iteration")
    want = expected(hybrid_model(device, **full_iteration), data, model_and_loss)
    saved = saved_bytes_per_layer(hybrid_model(device), data)

    def build() -> tuple[torch.nn.Module, object]:
        model = hybrid_model(device, **full_iteration)
        return model, offload_layers(model, 2, min_offload_numel=0, cuda_graph=True)

    found = whole_step(flavour, build, model_and_loss, data)
    assert_replays_eager(found, want)
    assert found.report.cuda_graph.warmup_steps == 1
    assert found.eager is not None  # most of what the 2 layers save moves, every step
    assert found.eager[0][0] >= 0.9 * sum(saved[:2]), (found.eager[0], saved)
