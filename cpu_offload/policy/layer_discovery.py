"""Finding a model's decoder layers, and the tensor a layer hands to the next one.

``offload_layers`` and the integrations take a whole model (Hugging Face, peft,
torchtune, Megatron-Core) and hook its decoder layers: :func:`find_layers` finds them
through the wrappers models come in; :func:`primary_tensor` picks, of whatever a layer
returns, the tensor the next layer takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "LAYER_PATHS",
    "find_layers",
    "locate_layer_container",
    "locate_layers",
    "primary_tensor",
]


def primary_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a layer hands to the next one: the output itself, or its first tensor
    (tuples, lists, mappings such as Hugging Face ``ModelOutput``, dataclasses)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        items: Any = output.values()
    elif isinstance(output, (tuple, list)):
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = (getattr(output, f.name) for f in dataclasses.fields(output))
    else:
        return None
    for item in items:
        found = primary_tensor(item)
        if found is not None:
            return found
    return None


#: where models keep their decoder layers, tried in this order
LAYER_PATHS = (
    "model.layers",  # Hugging Face Llama, Mistral, Qwen, Gemma, ...
    "model.decoder.layers",  # Hugging Face OPT, BART-style decoders
    "transformer.h",  # GPT-2, GPT-J, Falcon
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "decoder.layers",  # Megatron-Core GPTModel
    "layers",  # torchtune TransformerDecoder, a bare decoder
    "h",
)
#: wrappers looked through: peft, DDP / FSDP1, torch.compile, Megatron's Float16Module
_WRAPPERS = ("base_model", "module", "_orig_mod", "model")


def _candidates(model: nn.Module, depth: int = 4) -> list[tuple[str, nn.Module]]:
    """``model`` and the modules it wraps, outermost first, with their attribute paths."""
    found, frontier = [("", model)], [("", model)]
    for _ in range(depth):
        frontier = [
            (f"{path}{name}.", inner)
            for path, module in frontier
            for name in _WRAPPERS
            if isinstance(inner := getattr(module, name, None), nn.Module)
            and all(inner is not known for _, known in found)
        ]
        found.extend(frontier)
    return found


def _lookup(module: nn.Module, path: str) -> Any:
    found: Any = module
    for name in path.split("."):
        found = getattr(found, name, None)
        if found is None:
            return None
    return found


def _key_order(layers: nn.ModuleDict) -> str:
    """How the layers of a ``ModuleDict`` are numbered: its keys in iteration order."""
    keys = list(layers.keys())
    if len(keys) == 1:
        return f" (a ModuleDict: layer 0 is key {keys[0]!r})"
    last = len(keys) - 1
    return f" (a ModuleDict: layers 0-{last} are keys {keys[0]!r}..{keys[-1]!r} in iteration order)"


def find_layers(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The decoder layers of ``model``, or ``model`` itself when it is a list of layers.

    Looks, through peft / DDP / ``torch.compile`` wrappers, at the attribute paths in
    :data:`LAYER_PATHS` and takes the first ``ModuleList`` (or ``nn.Sequential``) found,
    or ``ModuleDict`` (torchtitan's ``model.layers``), whose layers are its values in
    iteration order.

    Raises:
        ValueError: no layer list was found; the message names what was looked for.
    """
    return locate_layers(model)[0]


def locate_layers(model: nn.Module | Sequence[nn.Module]) -> tuple[list[nn.Module], str]:
    """:func:`find_layers`, and where they were found: an attribute path of ``model``
    (``"model.layers"``), or ``"the list given"``."""
    layers, where, _ = locate_layer_container(model)
    return layers, where


def locate_layer_container(
    model: nn.Module | Sequence[nn.Module],
) -> tuple[list[nn.Module], str, nn.Module | None]:
    """:func:`locate_layers`, and the module that holds them (a ``ModuleList``,
    ``nn.Sequential`` or ``ModuleDict``; None for a plain list)."""
    if isinstance(model, (nn.ModuleList, nn.Sequential)):
        return list(model), "the list given", model
    if isinstance(model, (list, tuple)):
        return list(model), "the list given", None
    if isinstance(model, nn.ModuleDict):
        return list(model.values()), f"the ModuleDict given{_key_order(model)}", model
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"offload_layers: expected a model (nn.Module) or a list of layers, got "
            f"{type(model).__name__}."
        )
    for prefix, candidate in _candidates(model):
        for path in LAYER_PATHS:
            layers = _lookup(candidate, path)
            if isinstance(layers, (nn.ModuleList, nn.Sequential)) and len(layers) > 0:
                return list(layers), prefix + path, layers
            if isinstance(layers, nn.ModuleDict) and len(layers) > 0:  # torchtitan
                return list(layers.values()), prefix + path + _key_order(layers), layers
    raise ValueError(
        f"offload_layers: could not find the decoder layers of {type(model).__name__}: "
        f"looked for a ModuleList or ModuleDict at {', '.join(LAYER_PATHS)} (also inside "
        "base_model, "
        "module and _orig_mod wrappers). Pass the layers themselves, for example "
        "offload_layers(model.backbone.blocks, k)."
    )
