"""Named model shapes the benchmark and the planner both build (``models/llama.py``).

A preset is a Llama-like stack: width, heads, key-value heads, MLP width, and the
sequence, batch, depth and dtype it runs at.  ``python -m cpu_offload.bench --preset``
runs one, and ``python -m cpu_offload.plan --preset`` measures its layer.

:data:`MOE_PRESETS` are the planner's only (``models/moe.py``: a mixture of experts as
the MLP, with a balanced routing, NOTE [Balanced routing]); the benchmark runs the
dense ones.
"""

from __future__ import annotations

__all__ = ["MODEL_PRESETS", "MOE_PRESETS"]

MODEL_PRESETS: dict[str, dict[str, object]] = {
    # CPU smoke run, well under a minute on 2 cores.
    "tiny": dict(
        hidden=256, heads=4, kv_heads=2, ffn=688, seq=512, batch=2, layers=4, dtype="fp32"
    ),
    # One Llama-3-8B layer's shapes, a stack of 8.
    "llama8b-layer": dict(
        hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, batch=1, layers=8, dtype="bf16"
    ),
    # Host cost of the hooks per saved tensor (bench/hooks.py): 16 small layers of
    # Linear, GELU and LayerNorm; hidden is their width.
    "hooks": dict(hidden=64, heads=1, kv_heads=1, ffn=64, seq=1, batch=32, layers=16, dtype="fp32"),
}

# fmt: off
MOE_PRESETS: dict[str, dict[str, object]] = {
    # Mixtral-8x7B's shapes: Llama's attention (32/8 heads), 8 experts of ffn 14336, top 2.
    "mixtral8x7b-layer": dict(
        hidden=4096, heads=32, kv_heads=8, ffn=14336, experts=8, top_k=2, seq=4096, batch=1,
        layers=32, dtype="bf16",
    ),
    # The same layout, small: tests and CPU runs.
    "tiny-moe": dict(
        hidden=256, heads=4, kv_heads=2, ffn=344, experts=4, top_k=2, seq=512, batch=2,
        layers=4, dtype="fp32",
    ),
}
# fmt: on
