"""offload_layers(model, modules=...): choices per submodule, their names and their errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import tiny_hf_model
from hosts import require

from cpu_offload import offload_layers
from cpu_offload.policy.module_choices import KEEP, OFFLOAD, resolve_modules


def paths(layer, choices):
    names = {module: path for path, module in layer.named_modules()}
    return {names[m]: c for m, c in choices.items()}


def test_megatron_names_on_a_hugging_face_llama_layer():
    layer = tiny_hf_model("Llama", 3).model.layers[0]
    (choices,), rest = resolve_modules([layer], ["qkv_linear", "attn_norm", "mlp_norm"])
    assert rest == KEEP
    assert paths(layer, choices) == {
        "self_attn.q_proj": OFFLOAD,
        "self_attn.k_proj": OFFLOAD,
        "self_attn.v_proj": OFFLOAD,
        "input_layernorm": OFFLOAD,
        "post_attention_layernorm": OFFLOAD,
    }


def test_core_attn_is_the_attention_without_its_projections():
    layer = tiny_hf_model("Llama", 3).model.layers[0]
    (choices,), rest = resolve_modules([layer], {"core_attn": KEEP, "attn_proj": OFFLOAD})
    assert rest == OFFLOAD
    assert paths(layer, choices) == {
        "self_attn": KEEP,
        "self_attn.q_proj": OFFLOAD,  # the rest's choice
        "self_attn.k_proj": OFFLOAD,
        "self_attn.v_proj": OFFLOAD,
        "self_attn.o_proj": OFFLOAD,  # named
    }


def test_mixtral_and_torchtune_layouts():
    layer = tiny_hf_model("Mixtral", 3).model.layers[0]
    (choices,), _ = resolve_modules([layer], {"moe_act": KEEP, "mlp.gate": KEEP})
    assert paths(layer, choices) == {"mlp.experts.act_fn": KEEP, "mlp.gate": KEEP}
    models = require("torchtune.models.llama3")
    tune = models.llama3(
        vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=32
    )
    (choices,), _ = resolve_modules([tune.layers[0]], ["attn_norm", "attn_proj", "mlp_norm"])
    assert paths(tune.layers[0], choices) == {
        "sa_norm": OFFLOAD,
        "attn.output_proj": OFFLOAD,
        "mlp_norm": OFFLOAD,
    }


def test_an_unknown_name_lists_what_the_layer_has():
    model = tiny_hf_model("Llama", 3)
    with pytest.raises(ValueError, match="offload_layers: modules= names 'expert_fc1'") as info:
        offload_layers(model, 1, modules={"expert_fc1": OFFLOAD})
    message = str(info.value)
    assert "LlamaDecoderLayer" in message and "self_attn.q_proj" in message
    assert "qkv_linear" in message and "moe_act" in message  # what Megatron names exist
    assert not model.model.layers[0]._forward_pre_hooks  # nothing was installed


@pytest.mark.parametrize(
    "modules, error, match",
    [
        ({"mlp": "drop"}, ValueError, "maps submodule names to 'offload' or 'keep', got 'mlp'"),
        ({"rest": "checkpoint", "mlp": KEEP}, ValueError, "got 'rest': 'checkpoint'"),
        ("mlp", TypeError, "modules= must be a dict"),
        ({}, ValueError, "names no submodule"),
    ],
)
def test_bad_modules(modules, error, match):
    with pytest.raises(error, match=f"offload_layers: .*{match}"):
        offload_layers(tiny_hf_model("Llama", 3), 1, modules=modules)


def grads_and_stats(modules, **kwargs):
    model = tiny_hf_model("Llama", 3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    handle = offload_layers(model, min_offload_numel=0, modules=modules, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, labels=ids).loss.backward()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    return model, stats


def test_a_layer_the_policy_keeps_keeps_everything():
    """modules= refines offloaded layers only: "keep" and checkpointed layers ignore it."""
    _, stats = grads_and_stats(["qkv_linear"], policy=["keep", "checkpoint", "keep"])
    assert stats.tensors_offloaded == 0
    _, refined = grads_and_stats(["qkv_linear"], policy=["offload", "keep", "keep"])
    _, whole = grads_and_stats(None, policy=["offload", "keep", "keep"])
    assert 0 < refined.bytes_offloaded < whole.bytes_offloaded
    # a checkpointed, offloaded layer offloads its input, whatever the rest's choice
    _, inputs = grads_and_stats(["qkv_linear"], policy=["checkpoint+offload", "keep", "keep"])
    _, plain = grads_and_stats(None, policy=["checkpoint+offload", "keep", "keep"])
    assert inputs.bytes_offloaded == plain.bytes_offloaded > 0


def test_remove_and_copies_leave_no_hooks():
    model, _ = grads_and_stats({"core_attn": KEEP}, num_offloaded_layers=2)
    attention = model.model.layers[0].self_attn
    assert not attention._forward_pre_hooks and not attention._forward_hooks
    handle = offload_layers(model, 2, modules=["mlp"])
    clone = copy.deepcopy(model)  # its hooks pass through
    ids = torch.randint(0, 128, (2, 8))
    clone(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
