"""Real Hugging Face models (transformers, peft) through offload_layers, and a real Trainer
with OffloadCallback: gradients and parameters bit for bit against runs without offload."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from helpers import HF_VOCAB, Tokens, tiny_hf_model, trainer_args
from hosts import require
from torch.utils.checkpoint import checkpoint

from cpu_offload import offload_layers
from cpu_offload.policy.layer_discovery import find_layers

transformers = require("transformers")


def llama():
    return tiny_hf_model("Llama", 4, max_position_embeddings=64)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=HF_VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64
    )
    return transformers.GPT2LMHeadModel(config)


def llama_lora():
    peft = require("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(llama(), config)


def gradients(model, offload: bool):
    handle = offload_layers(model, 2, min_offload_numel=0) if offload else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning from cpu_offload either
        grads, _ = gradients_of(model)
    return grads, handle


def gradients_of(model):
    model.train()
    torch.manual_seed(1)
    ids = torch.randint(0, HF_VOCAB, (2, 32))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(deprecated|is_gradient_checkpointing).*")
        model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], None


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


class Recorder(transformers.TrainerCallback):
    """What the offload callback holds at each step."""

    def __init__(self, offload) -> None:
        self.offload = offload
        self.passes: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.passes.append(self.offload.handle.offload_synchronizer.stats.forward_passes)


def train(tmp_path, callbacks):
    model = llama()
    args = trainer_args(tmp_path, gradient_accumulation_steps=2, logging_strategy="no")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(16, 24), callbacks=callbacks
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


class PlanRecorder(transformers.TrainerCallback):
    """The plan and the bytes moved so far at each step's end."""

    def __init__(self, offload) -> None:
        self.offload = offload
        self.seen: list[tuple[object, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        handle = self.offload.handle
        self.seen.append((handle.plan, handle.offload_synchronizer.stats.bytes_offloaded))


def test_trainer_with_a_memory_budget_matches_a_run_without_it(tmp_path, capsys):
    from cpu_offload.integrations.transformers import OffloadCallback

    expected = train(tmp_path / "plain", [])
    callback = OffloadCallback(memory_budget="1B", min_offload_numel=0)  # nothing fits 1 byte
    recorder = PlanRecorder(callback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing fits; checkpointed layers drop the cache
        model = train(tmp_path / "offload", [callback, recorder])
    for (name, a), b in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(a, b), name
    (plan, first), (same, second) = recorder.seen
    assert plan is same and not plan.fits
    # step 1: a measured micro-batch, then one planned; step 2: two planned
    assert (first, second - first) == (plan.predicted.offloaded_bytes, 2 * first)
    assert capsys.readouterr().out.count("cpu_offload: offload_layers(memory_budget=1 B)") == 1
    assert callback.handle is None


def test_the_callback_takes_k_or_a_budget():
    from cpu_offload.integrations.transformers import OffloadCallback

    with pytest.raises(
        TypeError, match="^OffloadCallback: pass either .* or memory_budget=.*not both"
    ):
        OffloadCallback(1, memory_budget="1GiB")
    with pytest.raises(TypeError, match="got neither"):
        OffloadCallback()


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


def test_transformers_offload_true_beside_ours_says_which_moves_what(monkeypatch):
    """activation_checkpointing_enable(offload=True) runs the checkpoint inside a
    save_on_cpu of its own, inside our hooks (NOTE [Two offloaders on one layer])."""
    from transformers import modeling_utils

    own = torch.autograd.graph.save_on_cpu  # transformers pins: no pinned memory on a CPU
    monkeypatch.setattr(modeling_utils, "save_on_cpu", lambda **kw: own(device_type="cpu"))

    def offloaded_by_transformers():
        model = llama()
        model.activation_checkpointing_enable(offload=True)
        return model

    expected, _ = gradients(offloaded_by_transformers(), offload=False)
    with pytest.raises(UserWarning, match=r"offload=True\), whose save_on_cpu takes"):
        gradients(offloaded_by_transformers(), offload=True)  # warnings are errors there
    model = offloaded_by_transformers()
    handle = offload_layers(model, 2, min_offload_numel=0)
    with pytest.warns(UserWarning, match="cpu_offload moves nothing for this layer"):
        actual, _ = gradients_of(model)
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))
    assert handle.offload_synchronizer.stats.tensors_offloaded == 0
    handle.remove()


# ------------------------------------------------ every policy, at transformers' defaults


def qwen2():
    return tiny_hf_model("Qwen2", 4, max_position_embeddings=64)


POLICIES = {
    "keep": ["keep"] * 4,
    "offload": ["offload"] * 3 + ["keep"],
    "checkpoint": ["checkpoint"] * 4,
    "checkpoint+offload": ["checkpoint+offload"] * 3 + ["checkpoint"],
    "mixed": ["offload", "checkpoint+offload", "checkpoint", "keep"],
}
CACHE_WARNING = "which was called with use_cache=True and a cache in past_key_values"


def policy_step(model, policy, padded: bool):
    """One training step's output and gradients, the model as shipped (use_cache=True)."""
    model.zero_grad(set_to_none=True)
    handle = offload_layers(model, policy=policy, min_offload_numel=0) if policy else None
    torch.manual_seed(1)
    ids = torch.randint(0, HF_VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids, attention_mask=mask if padded else None, labels=ids)
        out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    ours = [str(w.message) for w in caught if str(w.message).startswith("cpu_offload")]
    return out, grads, handle, ours


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize("build", [gpt2, llama, qwen2], ids=["gpt2", "llama", "qwen2"])
def test_every_policy_runs_a_default_config_bit_identically(build, padded):
    """logits, loss and every gradient torch.equal to the plain model's; the cache it
    returns is the plain model's, less the entries of checkpointed layers, which run
    without it (as under transformers' gradient checkpointing)."""
    model = build()
    model.train()
    assert model.config.use_cache  # as shipped
    plain, expected, _, _ = policy_step(model, None, padded)
    assert plain.past_key_values.get_seq_length() == 16
    for name, policy in POLICIES.items():
        out, grads, handle, warned = policy_step(model, policy, padded)
        assert torch.equal(out.logits, plain.logits), name
        assert torch.equal(out.loss, plain.loss), name
        assert all(torch.equal(grads[p], expected[p]) for p in expected), name
        checkpointed = ["checkpoint" in choice for choice in policy]
        for index, cache in enumerate(out.past_key_values.layers):
            if checkpointed[index]:
                assert not cache.is_initialized, (name, index)
            else:
                assert torch.equal(cache.keys, plain.past_key_values.layers[index].keys)
                assert torch.equal(cache.values, plain.past_key_values.layers[index].values)
        assert len(warned) == any(checkpointed), (name, warned)
        assert all(CACHE_WARNING in w for w in warned), warned
        if "offload" in " ".join(policy):
            assert handle.offload_synchronizer.stats.tensors_offloaded > 0, name
        handle.remove()
        assert all("forward" not in layer.__dict__ for layer in find_layers(model))


def test_the_cache_is_what_transformers_gradient_checkpointing_leaves():
    """Checkpointing the same layers with transformers' own gradient checkpointing (its
    layer wrapper, on those layers only) gives the same cache and gradients."""
    policy = POLICIES["mixed"]
    ours, expected_grads, handle, warned = policy_step(llama(), policy, padded=True)
    handle.remove()
    model = llama()
    model.train()
    for layer, choice in zip(model.model.layers, policy):
        if "checkpoint" in choice:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    theirs, grads, _, _ = policy_step(model, None, padded=True)
    assert torch.equal(theirs.logits, ours.logits)
    assert all(torch.equal(grads[p], expected_grads[p]) for p in grads)
    for mine, hf in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert mine.is_initialized == hf.is_initialized
        if hf.is_initialized:
            assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
    assert warned == [
        "cpu_offload: offload_layers checkpoints layer 1 (LlamaDecoderLayer), which was "
        "called with use_cache=True and a cache in past_key_values. Its recompute in "
        "backward would append to the cache a second time, so checkpointed layers run "
        "without the cache, as under transformers' gradient checkpointing: the cache the "
        "model returns has no entries for them. Pass use_cache=False when training (or set "
        "model.config.use_cache = False) to leave the cache out. This warning is shown once "
        "per offload_layers handle."
    ]


def test_the_cache_warning_is_shown_once_per_handle_and_not_without_a_cache():
    model = gpt2()
    model.train()
    handle = offload_layers(model, policy=POLICIES["mixed"], min_offload_numel=0)
    ids = torch.randint(0, HF_VOCAB, (2, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        with torch.no_grad():  # generation: nothing is checkpointed, the cache is whole
            out = model(input_ids=ids)
    assert out.past_key_values.get_seq_length() == 16
    assert all(layer.is_initialized for layer in out.past_key_values.layers)
    ours = [str(w.message) for w in caught if str(w.message).startswith("cpu_offload")]
    assert len(ours) == 1 and "layer 1 (GPT2Block)" in ours[0]
    assert "called with use_cache=True and a cache in past_key_values" in ours[0]
    handle.remove()
