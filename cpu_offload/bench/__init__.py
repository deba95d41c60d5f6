"""``python -m cpu_offload.bench``: memory saved against time lost, ours and the peers.

Modules: ``config`` (presets and flags), ``modes`` (no offload, ours at several k,
``save_on_cpu``, checkpointing, torchtune), ``measure`` (one mode, and the raw copy
ceiling), ``report`` (table, JSON, plot).
"""

from __future__ import annotations

from .main import main, run_benchmark

__all__ = ["main", "run_benchmark"]
