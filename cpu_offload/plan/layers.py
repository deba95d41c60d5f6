"""Layers the planner measures: the benchmark's Llama presets and mixtures of experts
(``presets.py``), a GPT layer as in
Korthikanti et al. 2022 (section 4.1), and a Hugging Face config's own decoder layer."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from ..models import DTYPES
from ..models.llama import LlamaConfig, LlamaLayer
from ..models.moe import MoeConfig, MoeLayer
from ..models.presets import MODEL_PRESETS, MOE_PRESETS
from ..policy.layer_discovery import find_layers
from .hf_llama import DecoderLayer, check_sizes, layer_inputs, llama_shape

__all__ = ["GptLayer", "LayerSpec", "gpt_layer", "hf_layer", "preset_layer"]


@dataclass
class LayerSpec:
    """A layer to measure: how to build it, its inputs, and what it is."""

    make_layer: Callable[[], nn.Module] | nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    description: str
    num_layers: int | None = None  # of the model it comes from, when known

    def module(self) -> nn.Module:
        """The layer itself, on the meta device: ``make_layer`` is a module already (a
        Hugging Face config's layer, taken from its model) or builds one."""
        if isinstance(self.make_layer, nn.Module):
            return self.make_layer
        with torch.device("meta"):
            return self.make_layer()


def preset_layer(name: str, seq: int | None = None, batch: int | None = None) -> LayerSpec:
    """One layer of a preset: a benchmark's (``tiny``, ``llama8b-layer``) or a mixture
    of experts (``mixtral8x7b-layer``, ``tiny-moe``: NOTE [Balanced routing])."""
    presets = {**MODEL_PRESETS, **MOE_PRESETS}
    if name not in presets or name == "hooks":
        known = [p for p in presets if p != "hooks"]
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(known)}.")
    preset: dict[str, Any] = presets[name]
    shapes = dict(
        hidden=preset["hidden"], heads=preset["heads"], kv_heads=preset["kv_heads"],
        ffn=preset["ffn"], layers=1,
    )  # fmt: skip
    moe = ""
    if "experts" in preset:
        config: LlamaConfig = MoeConfig(**shapes, experts=preset["experts"], top_k=preset["top_k"])
        make: Callable[[], nn.Module] = lambda: MoeLayer(config)  # type: ignore[arg-type]  # noqa: E731
        moe = f", {preset['experts']} experts top {preset['top_k']} (balanced)"
    else:
        config = LlamaConfig(**shapes)
        make = lambda: LlamaLayer(config)  # noqa: E731
    dtype = DTYPES[preset["dtype"]]
    seq, batch = seq or preset["seq"], batch or preset["batch"]
    x = torch.empty(batch, seq, config.hidden, device="meta", dtype=dtype)
    return LayerSpec(
        lambda: make().to(dtype),
        (x,),
        {},
        f"{name}: hidden {config.hidden}, heads {config.heads}/{config.kv_heads}, ffn "
        f"{config.ffn}{moe}, seq {seq}, batch {batch}, {preset['dtype']}",
        num_layers=preset["layers"],
    )


class GptLayer(nn.Module):
    """A GPT layer as Korthikanti et al. 2022 count it (section 4.1): pre-LayerNorm, fused
    QKV, math attention with softmax dropout, GeLU MLP (4h), dropout after both blocks.
    Inputs are ``(s, b, h)``.  With ``sdpa=True`` the attention core is one
    ``scaled_dot_product_attention`` call (with the same dropout), so that a flash-style
    kernel can be measured in its place."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1, sdpa: bool = False) -> None:
        super().__init__()
        self.heads, self.dropout, self.sdpa = heads, dropout, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        s, b, h = t.shape  # -> (b * heads, s, h / heads), its own memory
        return t.reshape(s, b * self.heads, h // self.heads).transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = (self._heads(t) for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        if self.sdpa:
            q, k, v = (t.view(b, self.heads, s, h // self.heads) for t in (q, k, v))
            core = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)
            context = core.permute(2, 0, 1, 3).reshape(s, b, h)
            x = x + F.dropout(self.proj(context), self.dropout, True)
            return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, True)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(h // self.heads))
        probs = F.dropout(torch.softmax(scores, dim=-1), self.dropout, True)
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, h)
        x = x + F.dropout(self.proj(context), self.dropout, True)
        hidden = F.gelu(self.fc1(self.ln2(x)))
        return x + F.dropout(self.fc2(hidden), self.dropout, True)


def gpt_layer(
    seq: int, batch: int, hidden: int, heads: int, dtype: torch.dtype, attention: str = "math"
) -> LayerSpec:
    """A :class:`GptLayer` of these shapes, in ``dtype``; its attention core written out
    for ``attention="math"``, a ``scaled_dot_product_attention`` call otherwise."""
    x = torch.empty(seq, batch, hidden, device="meta", dtype=dtype)
    return LayerSpec(
        lambda: GptLayer(hidden, heads, sdpa=attention != "math").to(dtype),
        (x,),
        {},
        f"GPT layer (Korthikanti et al.): hidden {hidden}, heads {heads}, seq {seq}, "
        f"batch {batch}, {dtype}",
    )


def check_hf_config(config_source: str) -> tuple[str, dict[str, Any] | None]:
    """Where transformers should read ``config_source`` from, and the config when it is
    a local file, after checking what can be checked without transformers: a local
    JSON file (``config.json``, or any file ending in ``.json``; a folder stands for its
    ``config.json``) must exist and be a JSON object with ``model_type`` whose sizes are
    ints >= 1; anything else is a cached model name, which needs transformers.

    Raises:
        ValueError: a missing or malformed file, or a name without transformers installed.
    """
    path = config_source
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.exists(path) or config_source.endswith(".json"):
        if not os.path.isfile(path):
            raise ValueError(f"--hf-config {config_source}: no such file (expected a config.json)")
        try:
            with open(path) as file:
                config = json.load(file)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"--hf-config {config_source}: not a JSON file ({error})") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(
                f"--hf-config {config_source}: expected a Hugging Face config.json, a JSON "
                "object with a model_type field"
            )
        check_sizes(config_source, config)
        return os.path.abspath(path), config
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(
            f"--hf-config {config_source}: not a local file; a model name is read from the "
            "Hugging Face cache, which needs transformers (pip install transformers), or "
            "pass the path of its config.json"
        )
    return config_source, None


def llama_layer_from_config(
    source: str, config: dict[str, Any], seq: int, batch: int, dtype: torch.dtype, attention: str
) -> LayerSpec:
    """A Llama-family ``config.json`` read without transformers: its decoder layer as
    transformers computes it (:mod:`cpu_offload.plan.hf_llama`), with the inputs the
    model gives its first layer.

    Raises:
        ValueError: another model type (its layer needs transformers), or a config the
            layer does not model.
    """
    shape = llama_shape(source, config)
    implementation = "eager" if attention == "math" else "sdpa"
    inputs, kwargs = layer_inputs(shape, seq, batch, dtype, implementation)
    return LayerSpec(
        lambda: DecoderLayer(shape, implementation).to(dtype),
        inputs,
        kwargs,
        f"{source} ({shape.model_type}, read without transformers): {shape.describe()}, "
        f"seq {seq}, batch {batch}, {dtype}, attn_implementation {implementation}",
        num_layers=shape.layers,
    )


def hf_layer(
    config_source: str, seq: int, batch: int, dtype: torch.dtype, attention: str
) -> LayerSpec:
    """The first decoder layer of a Hugging Face model, built from its config alone.

    ``config_source`` is a local ``config.json`` (or its folder), or a model name already
    in the local cache; nothing is downloaded.  ``attention="math"`` builds the model with
    ``attn_implementation="eager"``, ``"flash"`` with ``"sdpa"``.  The layer's inputs are
    captured from a forward of the whole model on the meta device, with the config's
    ``use_cache`` (True as transformers ships most configs): the layer is measured as it
    runs in that model, appending to a cache when the model keeps one (a layer that
    ``offload_layers(policy=...)`` checkpoints runs without it, and saves only its
    inputs).
    """
    source, local = check_hf_config(config_source)
    if local is not None and importlib.util.find_spec("transformers") is None:
        return llama_layer_from_config(config_source, local, seq, batch, dtype, attention)
    import transformers  # the planner's optional host
    from transformers import masking_utils
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if local is not None and local["model_type"] not in CONFIG_MAPPING:
        raise ValueError(
            f"--hf-config {config_source}: model_type {local['model_type']!r} is not one this "
            f"transformers ({transformers.__version__}) knows"
        )
    try:
        if local is not None:  # this file, whatever its name (not its folder's config.json)
            config = CONFIG_MAPPING[local["model_type"]].from_dict(local)
        else:
            config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        if local is not None:
            raise ValueError(
                f"--hf-config {config_source}: transformers refuses the config: "
                f"{_first_line(error)}"
            ) from None
        raise ValueError(
            f"--hf-config {config_source}: neither a local config.json nor a model in the "
            f"Hugging Face cache (nothing is downloaded): {_first_line(error)}"
        ) from None
    config._attn_implementation = "eager" if attention == "math" else "sdpa"
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - any refusal of the user's config, said in one line
        raise ValueError(
            f"--hf-config {config_source}: transformers cannot build the model: "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from None
    layer = find_layers(model)[0]
    captured: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.update(args=args, kwargs=kwargs)
        raise _Captured

    hook = layer.register_forward_pre_hook(capture, with_kwargs=True)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # Looking for packed sequences reads position ids' values, which meta tensors lack;
    # a plan is for unpacked sequences.
    unpacked = mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda ids: None)
    try:
        with torch.no_grad(), unpacked:
            model(input_ids=ids)
    except _Captured:
        pass
    finally:
        hook.remove()
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in captured["args"])
    _fresh_caches(layer, [*args, *captured["kwargs"].values()], transformers.Cache)
    return LayerSpec(
        layer,
        args,
        captured["kwargs"],
        f"{type(layer).__name__} from {config_source}: hidden {config.hidden_size}, seq {seq}, "
        f"batch {batch}, {dtype}, attn_implementation {config._attn_implementation}",
        num_layers=config.num_hidden_layers,
    )


def _fresh_caches(layer: nn.Module, values: list[Any], cache_type: type) -> None:
    """Give ``layer`` a copy of each of these caches, as they are now (empty), at every
    call: the layer appends to a cache it is given, and each measurement of the layer,
    like each step of the model, starts from an empty one."""
    empty = {id(value): copy.deepcopy(value) for value in values if isinstance(value, cache_type)}

    def fresh(value: Any) -> Any:
        return copy.deepcopy(empty[id(value)]) if id(value) in empty else value

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return tuple(map(fresh, args)), {name: fresh(value) for name, value in kwargs.items()}

    if empty:
        layer.register_forward_pre_hook(hook, with_kwargs=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _Captured(Exception):
    """Stops the model's forward once the first layer's inputs are known."""
