"""``python -m cpu_offload.bench``: memory saved against time lost, ours and the peers.

Modules: ``config`` (presets and flags), ``modes`` (no offload, ours at several k,
``save_on_cpu``, checkpointing, torchtune), ``measure`` (one mode; the raw copy ceiling
is the device's, :mod:`cpu_offload.device.link`), ``report`` (table, JSON, plot).
Nothing that runs during training imports it.

May import: plan, policy, engine, report, hooks, device, models, testing, cli, context,
layer_hooks.
"""

from __future__ import annotations

from .main import main, run_benchmark

__all__ = ["main", "run_benchmark"]
