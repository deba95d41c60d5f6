"""Plan before you run: what offloading k layers saves and costs, from a model's shapes.

- :func:`measure_layer` (``census.py``): one layer's saved bytes, offloaded bytes and
  FLOPs, measured on the meta device with the offloader's own rules.
- :class:`DeviceProfile` (``profiles.py``): a device's compute rate and host link.
- :func:`simulate_policy` (``schedule_model.py``): an event model of the default
  schedule that predicts activation memory and exposed copy time of a policy.
- :func:`plan_offload` (``planner.py``): the model run for every k, and the answers
  drawn from it (the largest hidden k, the smallest k for a budget).
- :func:`choose_policy` (``policy_search.py``): for a memory budget, keep, offload,
  checkpoint or checkpoint+offload per layer, the fastest mix that fits.
- ``layers.py``, ``hf_llama.py``: the layers it measures (presets, a GPT layer, a Hugging
  Face config's decoder layer, with or without transformers installed).
- :func:`~cpu_offload.plan.pipeline.plan_pipeline` (``pipeline.py``): a plan per pipeline
  stage, from torch's schedule orders and the passes each stage keeps in flight.
- ``python -m cpu_offload.plan``: the same from the command line.
- :class:`~cpu_offload.plan.auto_policy.AutoPolicy` (``auto_policy.py``): the plan
  chosen for ``offload_layers(model, memory_budget=...)`` from a measured step, applied
  and watched; the core reaches it lazily, so ``import cpu_offload`` loads no planner.
- :func:`~cpu_offload.plan.stage_plan.choose_for_stage` (``stage_plan.py``): the plan
  of a pipeline stage with several passes in flight, ``keep_passes`` included.

May import: policy, engine, report, hooks, device, models, cli, log.
"""

from __future__ import annotations

from ..device.profiles import PROFILES, DeviceProfile
from .census import ATTENTIONS, LayerProfile, measure_layer
from .planner import Plan, plan_offload
from .policy_search import PolicyPlan, choose_policy
from .schedule_model import PlanRow, simulate, simulate_policy

__all__ = [
    "ATTENTIONS",
    "PROFILES",
    "DeviceProfile",
    "LayerProfile",
    "Plan",
    "PlanRow",
    "PolicyPlan",
    "choose_policy",
    "measure_layer",
    "plan_offload",
    "simulate",
    "simulate_policy",
]
