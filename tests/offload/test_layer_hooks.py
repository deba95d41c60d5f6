"""offload_layers on a Llama-like model: any output type, remove(), generation."""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict

import pytest
import torch
from helpers import assert_bit_identical
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import checkpoint

from cpu_offload import offload_layers
from cpu_offload.models.llama import Llama, LlamaConfig

pytestmark = pytest.mark.usefixtures("streams")

CONFIG = LlamaConfig(hidden=64, heads=4, kv_heads=2, ffn=96, layers=4, vocab=128)


class ModelOutput(OrderedDict):
    """Like Hugging Face's ModelOutput: a mapping whose first value is the hidden state."""


@dataclasses.dataclass
class DataclassOutput:
    hidden_states: torch.Tensor
    extra: int = 0


class Wrapped(nn.Module):
    """A decoder layer returning its hidden states in one of several containers."""

    def __init__(self, layer: nn.Module, kind: str) -> None:
        super().__init__()
        self.layer, self.kind = layer, kind

    def forward(self, x):
        if isinstance(x, (tuple, list)):
            x = x[0]
        elif isinstance(x, ModelOutput):
            x = x["hidden_states"]
        elif isinstance(x, DataclassOutput):
            x = x.hidden_states
        y = self.layer(x)
        if self.kind == "tuple":
            return (y, None)
        if self.kind == "mapping":
            return ModelOutput(hidden_states=y, attentions=None)
        if self.kind == "dataclass":
            return DataclassOutput(y)
        return y


def build(kind: str) -> Llama:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    model.layers = nn.ModuleList(Wrapped(layer, kind) for layer in model.layers)
    return model


def first(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, ModelOutput):
        return x["hidden_states"]
    if isinstance(x, DataclassOutput):
        return x.hidden_states
    return x[0]


def loss_and_grads(model: Llama, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = model.embed(tokens[:, :-1])
    for layer in model.layers:
        x = layer(x)
    logits = model.head(model.norm(first(x)))
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


TOKENS = torch.randint(0, CONFIG.vocab, (2, 33), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["tensor", "tuple", "mapping", "dataclass"])
def test_gradients_bit_identical_for_every_output_type(kind):
    model = build(kind)
    expected = loss_and_grads(model, TOKENS)
    handle = offload_layers(model.layers, 2, min_offload_numel=0)
    for _ in range(2):
        actual = loss_and_grads(model, TOKENS)
        assert_bit_identical(expected, actual)
    stats = handle.offload_synchronizer.stats
    assert stats.tensors_offloaded > 0 and stats.on_demand_reloads == 0
    assert stats.forward_passes == 2
    handle.remove()


def test_remove_restores_the_modules():
    model = build("tensor")
    handle = offload_layers(model.layers, 2, min_offload_numel=0)
    loss_and_grads(model, TOKENS)
    offloaded = handle.offload_synchronizer.stats.tensors_offloaded
    handle.remove()
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in model.layers)
    loss_and_grads(model, TOKENS)
    assert handle.offload_synchronizer.stats.tensors_offloaded == offloaded


def test_eval_generation_under_no_grad():
    model = build("tensor").eval()
    prompt = TOKENS[:, :5]
    expected = model.generate(prompt, 4)
    with offload_layers(model.layers, 3, min_offload_numel=0) as handle:
        actual = model.generate(prompt, 4)
    assert torch.equal(expected, actual)
    # no_grad passes save nothing and are not counted (NOTE [A pass that saves nothing])
    assert handle.offload_synchronizer.stats.forward_passes == 0
    assert handle.offload_synchronizer.stats.tensors_offloaded == 0


def test_exception_in_a_layer_discards_the_pass():
    model = build("tensor")
    expected = loss_and_grads(model, TOKENS)
    handle = offload_layers(model.layers, 2, min_offload_numel=0)

    def explode(module, args):
        raise RuntimeError("boom")

    hook = model.layers[2].register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        loss_and_grads(model, TOKENS)
    hook.remove()
    assert not handle.context.active
    assert handle.offload_synchronizer.current_pass is None
    assert_bit_identical(expected, loss_and_grads(model, TOKENS))


def test_exception_inside_forward_discards_the_pass():
    model = build("tensor")
    expected = loss_and_grads(model, TOKENS)
    handle = offload_layers(model.layers, 2, min_offload_numel=0)
    original = model.layers[1].forward
    model.layers[1].forward = lambda x: (_ for _ in ()).throw(ValueError("inside"))
    with pytest.raises(ValueError, match="inside"):
        loss_and_grads(model, TOKENS)
    model.layers[1].forward = original
    assert not handle.context.active and handle.offload_synchronizer.current_pass is None
    assert_bit_identical(expected, loss_and_grads(model, TOKENS))


class RopeLikeLayer(nn.Linear):
    def forward(self, x, freqs):
        return super().forward(x) * freqs[: x.shape[0]]  # saves a slice of the buffer


class TinyDecoder(nn.Module):
    """Hugging Face's layout: ``model.layers``, and a RoPE-like cache as a buffer of the
    model whose slice every layer saves."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(RopeLikeLayer(8, 8) for _ in range(layers))
        self.register_buffer("freqs", torch.randn(64, 8))

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x, self.freqs)
        return x


def _step(model, handle):
    x = torch.randn(16, 8, requires_grad=True)
    model(x).sum().backward()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    return stats


def test_offload_layers_finds_the_layers_and_keeps_buffers_on_the_device():
    torch.manual_seed(0)
    model = TinyDecoder()
    # Given the layer list only, the buffer is not the layers': its slices move.
    moved_with_buffer = _step(model, offload_layers(model.model.layers, 2, min_offload_numel=0))
    handle = offload_layers(model, 2, min_offload_numel=0)
    assert handle.offload_synchronizer.num_layers == 4
    stats = _step(model, handle)
    assert stats.tensors_offloaded == moved_with_buffer.tensors_offloaded - 2  # one per layer


@pytest.mark.parametrize("fraction, expected", [(0.5, 2), (0.3, 1), (0.0, 0), (0.99, 3)])
def test_k_may_be_a_fraction_of_the_layers(fraction, expected):
    handle = offload_layers(TinyDecoder(), fraction)
    assert handle.offload_synchronizer.num_offloaded_layers == expected
    handle.remove()


@pytest.mark.parametrize(
    "k, error, match",
    [
        (1.0, ValueError, r"a fractional k must be in \[0, 1\), got 1.0"),
        (True, TypeError, "k must be an int or a fraction, got True"),
    ],
)
def test_k_errors(k, error, match):
    with pytest.raises(error, match=match):
        offload_layers(TinyDecoder(), k)


def test_a_model_without_known_layers_is_refused_with_what_was_looked_for():
    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    with pytest.raises(ValueError) as caught:
        offload_layers(Backbone(), 1)
    message = str(caught.value)
    assert "could not find the decoder layers of Backbone" in message
    assert "model.layers, model.decoder.layers, transformer.h" in message
    assert "offload_layers(model.backbone.blocks, k)" in message


def test_wrappers_are_looked_through():
    class Wrapper(nn.Module):  # like DDP, or peft's base_model
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    inner = TinyDecoder(layers=3)
    compiled_like = nn.Module()
    compiled_like._orig_mod = Wrapper(inner)
    handle = offload_layers(compiled_like, 1)
    assert handle.offload_synchronizer.num_layers == 3
    handle.remove()


def _stack(layers: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)))


def test_hooks_seen_by_the_first_forward_stop_watching_for_missed_ones():
    model = _stack()
    handle = offload_layers(list(model), 2, min_offload_numel=0)
    assert len(handle._watchers) == 3  # one gradient hook per layer until a forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 8)).sum().backward()
    assert handle._watchers == [] and handle.forwards_seen == 3
    handle.remove()


def test_disabled_hooks_pass_forwards_through():
    model = _stack()
    handle = offload_layers(list(model), 2, min_offload_numel=0)
    handle.enabled = False
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert handle.offload_synchronizer.stats.forward_passes == 0
    handle.enabled = True
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    handle.remove()


class SelfCheckpointing(nn.Module):
    """Like a Hugging Face GradientCheckpointingLayer: it checkpoints its own call."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.gradient_checkpointing = True

    def __call__(self, x):
        return checkpoint(super().__call__, x, use_reentrant=False)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize(
    "wrap, advice",
    [
        ("after", "Wrap the layers for checkpointing first"),
        ("self", "upgrade transformers, or use gradient checkpointing or offload_layers"),
    ],
)
def test_hooks_inside_a_checkpoint_warn_with_advice_for_the_case(wrap, advice):
    torch.manual_seed(0)
    if wrap == "self":
        layers = [SelfCheckpointing() for _ in range(3)]
        handle = offload_layers(layers, 2, min_offload_numel=0)
    else:
        inner = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
        handle = offload_layers(inner, 2, min_offload_numel=0)
        layers = [CheckpointWrapper(layer) for layer in inner]  # wrapped after the hooks
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="runs inside activation checkpointing") as caught:
        for _ in range(2):
            h = x
            for layer in layers:
                h = layer(h)
            h.sum().backward()
    messages = [str(w.message) for w in caught if "cpu_offload" in str(w.message)]
    assert len(messages) == 1 and advice in messages[0]  # once per handle
    assert handle.offload_synchronizer.stats.tensors_offloaded == 0
    handle.remove()


def test_hooks_on_checkpoint_wrappers_offload_their_inputs_without_warning():
    torch.manual_seed(0)
    layers = [CheckpointWrapper(nn.Sequential(nn.Linear(8, 8), nn.Tanh())) for _ in range(3)]
    handle = offload_layers(layers, 2, min_offload_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = torch.randn(4, 8, requires_grad=True)
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    assert handle.offload_synchronizer.stats.tensors_offloaded == 2  # each wrapper's input
    handle.remove()
