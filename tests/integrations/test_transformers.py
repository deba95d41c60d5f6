"""Real Hugging Face models (transformers, peft) through offload_layers, and a real Trainer
with OffloadCallback: gradients and parameters bit for bit against runs without offload."""

from __future__ import annotations

import warnings

import pytest
import torch
from hosts import require

from cpu_offload import offload_layers

transformers = require("transformers")

VOCAB = 128


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64
    )
    return transformers.GPT2LMHeadModel(config)


def llama_lora():
    peft = require("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(llama(), config)


def gradients(model, offload: bool):
    model.train()
    handle = offload_layers(model, 2, min_offload_numel=0) if offload else None
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning from cpu_offload either
        warnings.filterwarnings("ignore", message=".*(deprecated|is_gradient_checkpointing).*")
        model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads, handle


@pytest.mark.parametrize("build", [llama, gpt2, llama_lora], ids=["llama", "gpt2", "peft-lora"])
def test_offload_layers_finds_the_layers_of_real_models(build):
    expected, _ = gradients(build(), offload=False)
    model = build()
    actual, handle = gradients(model, offload=True)
    assert len(actual) == len(expected) > 0
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))
    assert handle.offload_synchronizer.num_layers == 4
    stats = handle.offload_synchronizer.stats
    assert stats.tensors_offloaded > 10 and stats.tensors_reloaded == stats.tensors_offloaded
    handle.remove()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 16, length: int = 24) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, VOCAB, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Recorder(transformers.TrainerCallback):
    """What the offload callback holds at each step."""

    def __init__(self, offload) -> None:
        self.offload = offload
        self.passes: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.passes.append(self.offload.handle.offload_synchronizer.stats.forward_passes)


def train(tmp_path, callbacks):
    model = llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=callbacks
    )
    trainer.train()
    return model


def test_trainer_with_the_callback_matches_a_run_without_it(tmp_path):
    from cpu_offload.integrations.transformers import OffloadCallback

    expected = train(tmp_path / "plain", [])
    callback = OffloadCallback(0.5, min_offload_numel=0)
    recorder = Recorder(callback)
    model = train(tmp_path / "offload", [callback, recorder])
    for (name, a), b in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(a, b), name
    assert recorder.passes == [2, 4]  # two micro-batches per step, through the hooks
    assert callback.handle is None  # removed when training ended
    assert all(not layer._forward_hooks for layer in model.model.layers)


def test_the_callback_needs_a_model():
    from cpu_offload.integrations.transformers import OffloadCallback

    with pytest.raises(ValueError, match="the Trainer passed no model to on_train_begin"):
        OffloadCallback(1).on_train_begin(None, None, None)


def checkpointed_llama():
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_hugging_face_gradient_checkpointing_offloads_the_checkpoint_inputs():
    """transformers 5 checkpoints a layer's forward inside its call: the hooks stay
    outside the checkpoint and offload what it saves (the layer's inputs)."""
    expected, _ = gradients(checkpointed_llama(), offload=False)
    actual, handle = gradients(checkpointed_llama(), offload=True)
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))
    stats = handle.offload_synchronizer.stats
    assert 2 <= stats.tensors_offloaded < 10  # the inputs of 2 checkpointed layers, not more
    handle.remove()
