"""A Hugging Face config read without transformers: its sizes checked, and the decoder
layer of a Llama-family config (``llama``, ``mistral``, ``qwen2``) computed op for op as
transformers computes it, so that the planner measures the same saved tensors.

NOTE [The layer transformers builds]
The census counts the tensors autograd saves, so a layer that computes the same
function another way (rotary embeddings in float32, a fused gate and up projection)
saves other bytes.  :class:`DecoderLayer` therefore takes the operations of
transformers' ``LlamaDecoderLayer`` (and of Mistral's and Qwen2's, which differ from it
in their biases and masks) in their order and dtypes: RMSNorm in float32 with the
weight applied in the input's dtype; q, k and v projected apart; rotary embeddings
applied as ``x * cos + rotate_half(x) * sin`` with ``cos`` and ``sin`` in the model's
dtype, made once by the model and passed to every layer; attention as transformers'
``sdpa`` or ``eager`` function calls it; the MLP as ``down(act(gate(x)) * up(x))``.
``tests/plan/test_hf_llama.py`` holds the census of this layer equal to that of
transformers' own, tensor for tensor.  A config this layer does not model (another
activation, a sliding-window mask under eager attention, ...) is refused with what
to install.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LLAMA_FAMILY",
    "DecoderLayer",
    "LlamaShape",
    "check_sizes",
    "layer_inputs",
    "llama_shape",
]

#: model types whose decoder layer :class:`DecoderLayer` computes
LLAMA_FAMILY = ("llama", "mistral", "qwen2")

#: config fields that are sizes (an int >= 1) wherever a config has them; ``None``
#: allowed where transformers fills the field in
SIZE_FIELDS = {
    "hidden_size": False,
    "intermediate_size": False,
    "num_attention_heads": False,
    "num_hidden_layers": False,
    "vocab_size": False,
    "max_position_embeddings": False,
    "num_key_value_heads": True,
    "head_dim": True,
    "sliding_window": True,
    "n_embd": False,
    "n_head": False,
    "n_layer": False,
    "n_positions": False,
    "n_inner": True,
    "ffn_dim": False,
    "d_model": False,
}

#: each family's defaults for the fields a config may leave out (transformers' own)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=None, head_dim=None, hidden_act="silu", attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, sliding_window=None,
    ),
    "mistral": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=None, hidden_act="silu", attention_dropout=0.0,
        sliding_window=4096,
    ),
    "qwen2": dict(
        hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="silu", attention_dropout=0.0, sliding_window=4096,
        use_sliding_window=False, max_window_layers=28, layer_types=None,
    ),
}  # fmt: skip

#: activations (``hidden_act``) and the function transformers runs for each
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def check_sizes(source: str, config: dict[str, Any]) -> None:
    """Refuse a config whose sizes no model can have: a size field that is not an int
    >= 1 (negative, zero, fractional, a string, or null where transformers needs it),
    or attention heads that do not divide into key-value heads.

    Raises:
        ValueError: naming the field, its value and what is allowed.
    """
    for name, nullable in SIZE_FIELDS.items():
        if name not in config:
            continue
        value = config[name]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"--hf-config {source}: {name} is {json_text(value)}; expected an int >= 1"
                + (" or null" if nullable else "")
            )
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ValueError(
            f"--hf-config {source}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}; expected key-value heads that divide the heads"
        )


def json_text(value: object) -> str:
    """A config value as the JSON file spells it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True)
class LlamaShape:
    """What of a Llama-family config decides what its decoder layer saves."""

    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    activation: str
    attention_dropout: float
    sliding_window: int | None  # of the first layer, where it has one

    def describe(self) -> str:
        return (
            f"hidden {self.hidden}, heads {self.heads}/{self.kv_heads} of {self.head_dim}, "
            f"ffn {self.ffn}"
        )


def llama_shape(source: str, config: dict[str, Any]) -> LlamaShape:
    """The :class:`LlamaShape` of a Llama-family config, with transformers' defaults for
    the fields it leaves out.

    Raises:
        ValueError: another model type, or what :class:`DecoderLayer` does not model.
    """
    model_type = config.get("model_type")
    if model_type not in LLAMA_FAMILY:
        raise ValueError(
            f"--hf-config {source}: model_type {model_type!r} needs transformers to build "
            f"its layer (pip install transformers); without it the planner reads "
            f"{', '.join(LLAMA_FAMILY)} configs"
        )
    check_sizes(source, config)
    given = {**DEFAULTS[model_type], **config}
    heads, hidden = given["num_attention_heads"], given["hidden_size"]
    kv_heads = given["num_key_value_heads"] or heads
    if model_type == "llama" and hidden % heads:
        raise ValueError(
            f"--hf-config {source}: hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {heads}; transformers refuses such a Llama config"
        )
    if heads % kv_heads:
        raise ValueError(
            f"--hf-config {source}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}; expected key-value heads that divide the heads"
        )
    activation = given["hidden_act"]
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"--hf-config {source}: hidden_act {activation!r} needs transformers to measure "
            f"(pip install transformers); without it the planner knows {', '.join(ACTIVATIONS)}"
        )
    dropout = given["attention_dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(
            f"--hf-config {source}: attention_dropout is {json_text(dropout)}; expected a "
            "number in [0, 1)"
        )
    llama = model_type == "llama"
    return LlamaShape(
        model_type=model_type,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=given.get("head_dim") or hidden // heads,
        ffn=given["intermediate_size"],
        layers=given["num_hidden_layers"],
        # Llama's biases follow its config; Qwen2 has them on q, k and v; Mistral has none.
        qkv_bias=llama and bool(given["attention_bias"]) or model_type == "qwen2",
        out_bias=llama and bool(given["attention_bias"]),
        mlp_bias=llama and bool(given["mlp_bias"]),
        activation=activation,
        attention_dropout=float(dropout),
        sliding_window=_first_layer_window(model_type, given),
    )


def _first_layer_window(model_type: str, given: dict[str, Any]) -> int | None:
    """The sliding window of the first layer's attention, or None (full attention)."""
    window = given.get("sliding_window")
    if model_type == "mistral":
        return window
    if model_type == "qwen2":
        if not given.get("use_sliding_window"):
            return None
        types = given.get("layer_types")
        if isinstance(types, list) and types:
            return window if types[0] == "sliding_attention" else None
        return window if given.get("max_window_layers") == 0 else None
    return None  # llama has none


class RMSNorm(nn.Module):
    """Root-mean-square normalisation, its statistics in float32 and its weight applied
    in the input's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        mean_square = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(mean_square + self.eps)
        return self.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings: the second half of the features, negated, before the first."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (turned * sin)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """Each key-value head ``times`` over, as one tensor (batch, heads, seq, dim)."""
    if times == 1:
        return x
    batch, heads, seq, dim = x.shape
    expanded = x[:, :, None, :, :].expand(batch, heads, times, seq, dim)
    return expanded.reshape(batch, heads * times, seq, dim)


class DecoderLayer(nn.Module):
    """A Llama-family decoder layer as transformers computes it (NOTE [The layer
    transformers builds]); ``attention`` is ``"sdpa"`` or ``"eager"``."""

    def __init__(self, shape: LlamaShape, attention: str) -> None:
        super().__init__()
        self.shape, self.attention = shape, attention
        hidden, dim = shape.hidden, shape.head_dim
        self.input_norm = RMSNorm(hidden)
        self.q = nn.Linear(hidden, shape.heads * dim, bias=shape.qkv_bias)
        self.k = nn.Linear(hidden, shape.kv_heads * dim, bias=shape.qkv_bias)
        self.v = nn.Linear(hidden, shape.kv_heads * dim, bias=shape.qkv_bias)
        self.o = nn.Linear(shape.heads * dim, hidden, bias=shape.out_bias)
        self.post_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, shape.ffn, bias=shape.mlp_bias)
        self.up = nn.Linear(hidden, shape.ffn, bias=shape.mlp_bias)
        self.down = nn.Linear(shape.ffn, hidden, bias=shape.mlp_bias)
        self.act = ACTIVATIONS[shape.activation]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        x = self.input_norm(hidden_states)
        split = (*x.shape[:-1], -1, self.shape.head_dim)
        q, k, v = (proj(x).view(split).transpose(1, 2) for proj in (self.q, self.k, self.v))
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.attention == "eager":
            out = self._eager(q, k, v, attention_mask)
        else:
            out = self._sdpa(q, k, v, attention_mask)
        x = residual + self.o(out.reshape(*x.shape[:-1], -1).contiguous())
        residual = x
        x = self.post_norm(x)
        return residual + self.down(self.act(self.gate(x)) * self.up(x))

    def _dropout(self) -> float:
        return self.shape.attention_dropout if self.training else 0.0

    def _eager(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        groups = self.shape.heads // self.shape.kv_heads
        k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.shape.head_dim**-0.5
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        weights = F.dropout(weights, p=self._dropout(), training=self.training)
        return torch.matmul(weights, v).transpose(1, 2).contiguous()

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        groups = self.shape.heads // self.shape.kv_heads
        seq = q.shape[2]
        options: dict[str, Any] = {}
        if groups > 1:
            if mask is None and k.shape[-1] == v.shape[-1] <= 256:
                options["enable_gqa"] = True
            elif seq == 1:  # one query: its heads grouped by their key-value head
                q = q.reshape(q.shape[0], q.shape[1] // groups, groups, q.shape[-1])
            else:
                k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self._dropout(),
            scale=self.shape.head_dim**-0.5,
            is_causal=seq > 1 and mask is None,
            **options,
        )
        out = out.reshape(out.shape[0], -1, seq, v.shape[-1])
        return out.transpose(1, 2).contiguous()


def layer_inputs(
    shape: LlamaShape, seq: int, batch: int, dtype: torch.dtype, attention: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first layer's inputs as the model makes them, on the meta device: the
    embeddings, ``cos`` and ``sin`` in the model's dtype (one position row, shared by the
    batch), and the mask: none for sdpa unless a sliding window shorter than the
    sequence needs one (booleans of one sequence, expanded over the batch); additive
    for eager attention."""
    meta = torch.device("meta")
    x = torch.empty(batch, seq, shape.hidden, dtype=dtype, device=meta)
    cos, sin = (torch.empty(1, seq, shape.head_dim, dtype=dtype, device=meta) for _ in "cs")
    mask: torch.Tensor | None = None
    if attention == "eager":
        mask = torch.empty(batch, 1, seq, seq, dtype=dtype, device=meta)
    elif shape.sliding_window is not None and seq >= shape.sliding_window:
        mask = torch.empty(1, 1, seq, seq, dtype=torch.bool, device=meta).expand(batch, 1, seq, seq)
    return (x,), {"position_embeddings": (cos, sin), "attention_mask": mask}
