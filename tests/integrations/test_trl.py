"""TRL as its users run it: ``SFTConfig(activation_offloading=True)`` with our function in
place of TRL's (cpu_offload.integrations.trl), on the CPU, where TRL's own needs an
accelerator."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import HF_VOCAB, tiny_hf_model
from hosts import require

from cpu_offload.integrations import trl as offload_trl

trl = require("trl")
datasets = require("datasets")
transformers = require("transformers")


def tokenizer():
    """A word-level tokenizer of the tiny models' vocabulary, built here (no download)."""
    from tokenizers import Tokenizer, models

    words = {f"t{i}": i for i in range(HF_VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
        pad_token="t1",
        eos_token="t2",
    )


def sft(tmp_path, activation_offloading: bool):
    """Two SFT steps of a 4-layer Llama on pre-tokenized rows; the trainer and its model."""
    generator = torch.Generator().manual_seed(2)
    rows = torch.randint(3, HF_VOCAB, (8, 24), generator=generator).tolist()
    model = tiny_hf_model("Llama", 4)
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=3,
        activation_offloading=activation_offloading,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        processing_class=tokenizer(),
    )
    trainer.train()
    return trainer, model


def test_sft_trainer_with_our_function_moves_bytes_and_matches_a_run_without(tmp_path):
    _, expected = sft(tmp_path / "plain", False)
    with offload_trl.patch():
        trainer, model = sft(tmp_path / "offload", True)
    ctx = trainer.maybe_activation_offload_context
    assert isinstance(ctx, offload_trl.OffloadLayersContext)
    stats = ctx.offload_synchronizer.stats
    assert stats.forward_passes == 2 and stats.bytes_offloaded > 0
    assert stats.bytes_reloaded == stats.bytes_offloaded
    for (name, a), b in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(a, b), name
    # leaving the patch puts TRL's own function back where the trainers read it
    sft_module = importlib.import_module("trl.trainer.sft_trainer")
    own = importlib.import_module("trl.models.activation_offloading")
    assert sft_module.get_act_offloading_ctx_manager is own.get_act_offloading_ctx_manager
    ctx.remove()


def layers_of(widths: list[int]) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(w, w) for w in widths)
    return model


def test_trls_call_moves_what_trls_threshold_moves():
    # rows of 8 floats: a 16-wide input is 512 bytes (stays), 32 wide 1,024 (moves)
    model = layers_of([16, 16, 32, 32, 32])
    model.layers.insert(2, torch.nn.Linear(16, 32))
    ctx = offload_trl.get_act_offloading_ctx_manager(model=model)  # TRL's trainers' call
    assert ctx.handle.k == len(model.layers) - 1
    x = torch.randn(8, 16, requires_grad=True)
    with ctx:
        for layer in model.layers:
            x = layer(x)
        x.sum().backward()
    stats = ctx.offload_synchronizer.stats
    # layers 0-2 save 512-byte inputs, layers 3-4 1,024-byte ones; layer 5 is kept
    assert (stats.tensors_offloaded, stats.bytes_offloaded) == (2, 2048)
    ctx.remove()


def test_trls_positional_order_and_defaults():
    ctx = offload_trl.OffloadActivations(True, True, 4096, 3)  # TRL's order
    assert "min_offload_bytes=4096" in ctx.offload_synchronizer.thresholds()
    default = offload_trl.OffloadActivations().offload_synchronizer.thresholds()
    assert "min_offload_bytes=1024" in default
    with pytest.raises(ValueError, match="max_fwd_stash_size must be >= 1"):
        offload_trl.OffloadActivations(True, True, 1024, 0)
    model = layers_of([32, 32, 32])
    ctx = offload_trl.get_act_offloading_ctx_manager(model, True, True, 4096)
    assert "min_offload_bytes=4096" in ctx.offload_synchronizer.thresholds()
    ctx.remove()


def test_the_patch_takes_options_and_the_trainers_keywords_win():
    with offload_trl.patch(num_offloaded_layers=1, min_offload_size=2048):
        own = importlib.import_module("trl.models").get_act_offloading_ctx_manager
        ctx = own(model=layers_of([32, 32, 32]), min_offload_size=4096)
    assert ctx.handle.k == 1
    assert "min_offload_bytes=4096" in ctx.offload_synchronizer.thresholds()
    ctx.remove()
