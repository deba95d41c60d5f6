"""A Llama-family config.json planned without transformers measures what transformers'
own layer saves, tensor for tensor; configs it does not model say so."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hosts import require

import cpu_offload.plan.layers as layers
from cpu_offload.plan import measure_layer
from cpu_offload.plan.layers import hf_layer

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "vocab_size": 128}

CONFIGS = {
    "llama-gqa": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2},
    "llama-mha-rope-scaling-biases": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "attention_bias": True,
        "mlp_bias": True,
    },
    "llama-head-dim-gelu-dropout": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "hidden_act": "gelu",
        "attention_dropout": 0.1,
    },
    "mistral-sliding-window": {
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "head_dim": 8,
    },
    "mistral-no-window": {
        "model_type": "mistral",
        "num_attention_heads": 8,
        "sliding_window": None,
    },
    "qwen2": {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen2-sliding-first-layer": {
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 0,
        "hidden_act": "relu",
    },
}


def without_transformers(monkeypatch):
    """The planner as it runs where transformers is not installed."""
    real = layers.importlib.util.find_spec
    monkeypatch.setattr(
        layers.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )


def census(path, seq, attention, min_numel, batch=2):
    spec = hf_layer(str(path), seq, batch, torch.bfloat16, attention)
    layer = measure_layer(
        spec.make_layer,
        spec.inputs,
        kwargs=spec.kwargs,
        min_offload_numel=min_numel,
        attention=attention,
        description=spec.description,
    )
    return spec, layer


@pytest.mark.parametrize("attention", ["flash", "cpu", "math"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_fallback_measures_what_transformers_layer_saves(
    tmp_path, monkeypatch, name, attention
):
    require("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, **CONFIGS[name]}))
    for seq, min_numel in ((16, 0), (16, 2**10), (1, 0)):
        theirs_spec, theirs = census(path, seq, attention, min_numel)
        with monkeypatch.context() as patch:
            without_transformers(patch)
            ours_spec, ours = census(path, seq, attention, min_numel)
        assert "read without transformers" in ours_spec.description
        assert ours_spec.num_layers == theirs_spec.num_layers == 3
        assert ours.saved == theirs.saved, (seq, min_numel)  # shape, dtype, why, in order
        mine, its = dataclasses.asdict(ours), dataclasses.asdict(theirs)
        mine.pop("description"), its.pop("description")
        for key in ("saved_by_module", "saved_by_kind"):
            # the same totals; the fallback's code is laid out otherwise (its own modules, ops)
            assert sum(mine.pop(key).values()) == sum(its.pop(key).values())
        mine.pop("forward_sites"), its.pop("forward_sites")  # their own submodules
        for key in ("forward_kernels", "backward_kernels", "recompute_kernels"):
            # transformers' layer also appends to its cache: a few kernels more
            assert _kernel_flops(mine.pop(key)) == _kernel_flops(its.pop(key))
        # the same storages in pack order; when each is unpacked counts their kernels
        mine_unpacks, its_unpacks = mine.pop("offloaded_unpacks"), its.pop("offloaded_unpacks")
        assert [n for n, _, _ in mine_unpacks] == [n for n, _, _ in its_unpacks]
        assert mine == its, (seq, min_numel)  # every byte count, class and FLOP


def _kernel_flops(kernels: list[tuple[int, int]]) -> int:
    return sum(flops for flops, _ in kernels)


def test_llama_3_8b_at_8k_without_transformers_is_transformers_answer(tmp_path, monkeypatch):
    """The config of issue 30: 1.853 GiB per layer without transformers, 1.536 with."""
    require("transformers")
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "vocab_size": 128256,
                "rope_theta": 500000.0,
            }
        )
    )
    _, theirs = census(path, 8192, "flash", 256 * 1024, batch=1)
    without_transformers(monkeypatch)
    _, ours = census(path, 8192, "flash", 256 * 1024, batch=1)
    assert ours.saved_bytes == theirs.saved_bytes == 1_649_475_608  # 1.536 GiB
    assert ours.offloaded_bytes == theirs.offloaded_bytes


#: Meta's published config.json of Llama-3-8B (meta-llama/Meta-Llama-3-8B)
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


@pytest.mark.parametrize("seq", [8192, 4096, 1000])
def test_the_llama8b_layer_preset_saves_what_transformers_llama_3_8b_layer_saves(tmp_path, seq):
    """``plan --preset llama8b-layer`` and ``--hf-config`` of the published Llama-3-8B
    config measure the same tensors (issue 39: the preset saved 1.853 GiB in 21 copies
    at seq 8192, transformers' layer 1.536 GiB in 17)."""
    require("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    _, theirs = census(path, seq, "flash", 256 * 1024, batch=1)
    spec = layers.preset_layer("llama8b-layer", seq, 1)
    ours = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=256 * 1024)
    assert sorted(ours.saved) == sorted(theirs.saved)  # shape, dtype and why, each
    for field in ("saved_bytes", "offloaded_bytes", "kept_bytes", "kept_by_reason"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.tensors_offloaded == theirs.tensors_offloaded
    assert ours.forward_flops == theirs.forward_flops
    assert ours.backward_flops == theirs.backward_flops
    if seq == 8192:
        assert ours.saved_bytes == 1_649_475_608 and ours.tensors_offloaded == 17  # 1.536 GiB


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' needs transformers to measure"),
        ({"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
        ({"attention_dropout": 1.5}, "attention_dropout is 1.5; expected a number in [0, 1)"),
        ({"model_type": "gpt2"}, "model_type 'gpt2' needs transformers to build its layer"),
    ],
    ids=["activation", "heads", "dropout", "model-type"],
)
def test_what_the_fallback_does_not_model_needs_transformers(
    tmp_path, monkeypatch, change, message
):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, **CONFIGS["llama-gqa"], **change}))
    without_transformers(monkeypatch)
    with pytest.raises(ValueError) as raised:
        hf_layer(str(path), 16, 1, torch.bfloat16, "flash")
    assert message in str(raised.value)
    assert str(raised.value).startswith(f"--hf-config {path}: ")


def test_missing_fields_take_transformers_defaults(tmp_path, monkeypatch):
    """A Mistral config without its sizes is Mistral-7B's shape, as transformers reads it."""
    require("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "num_hidden_layers": 2}))
    theirs_spec, theirs = census(path, 8, "flash", 0)
    without_transformers(monkeypatch)
    ours_spec, ours = census(path, 8, "flash", 0)
    assert ours.saved == theirs.saved and ours.saved_bytes == theirs.saved_bytes
    assert "hidden 4096, heads 32/8 of 128, ffn 14336" in ours_spec.description
