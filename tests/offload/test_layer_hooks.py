"""offload_layers on a Llama-like model: any output type, remove(), generation."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch
from helpers import assert_bit_identical
from torch import nn

from cpu_offload import offload_layers
from cpu_offload.llama import Llama, LlamaConfig

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
    assert handle.offload_synchronizer.stats.forward_passes == 4
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
