"""Plan before you run: what offloading k layers saves and costs, from a model's shapes.

The map of the folder, one room per concept:

- **measure**: :func:`measure_layer` (``census.py``, with ``module_census.py``: per
  submodule) measures one layer's saved bytes, offloaded bytes and FLOPs on the meta
  device with the offloader's own rules; ``layers.py`` and ``hf_llama.py`` are the
  layers it measures (presets, a GPT layer, a Hugging Face config's decoder layer, with
  or without transformers installed).
- **model**: :func:`simulate_policy` (``schedule_model.py``), the event model of one
  pass under the default schedule: activation memory and exposed copy time of a policy.
  The device's compute rate and link are a :class:`DeviceProfile` (``device/``).
- **search**: :func:`plan_offload` (``planner.py``) runs the model for every k and draws
  the answers (the largest hidden k, the smallest k for a budget, both within a host
  cap); :func:`choose_policy` (``policy_search.py``, ``many_policies.py``,
  ``policy_plan.py``) finds, for a memory budget, the fastest mix of keep, offload,
  checkpoint and checkpoint+offload per layer; ``module_search.py`` the same per
  submodule.
- **pipeline** (``pipeline/``): a plan per pipeline stage. Schedule orders from torch
  (``orders.py``), the stage model, one pure function from a rank's order, the stage's
  per-layer bytes and costs and a policy to its peak and step time (``stage_model.py``,
  its clocks in ``stage_clocks.py``), and the per-stage search
  (``search.py``: :func:`~cpu_offload.plan.pipeline.plan_pipeline`).
- **stage**: :func:`~cpu_offload.plan.stage_plan.choose_for_stage` (``stage_plan.py``),
  the plan of a stage with several passes in flight for a memory budget inside it,
  ``keep_passes`` included, on the stage model's peak.
- **budget**: :class:`~cpu_offload.plan.auto_policy.AutoPolicy` (``auto_policy.py``),
  the plan chosen for ``offload_layers(model, memory_budget=...)`` from a measured step,
  applied and watched; the core reaches it lazily, so ``import cpu_offload`` loads no
  planner.
- **command**: ``python -m cpu_offload.plan`` (``__main__.py`` runs a mode; in
  ``command/``: its flags in ``args.py``, what it prints in ``tables.py``, what it writes
  in ``output.py``; ``node.py``: a node's host memory).

Rooms (``room: its modules -> the other rooms it may import``; ``folder/``: every module
in it), checked by tests/test_structure.py:

    measure: census module_census layers hf_llama -> nothing
    model: schedule_model -> measure
    search: planner policy_search many_policies policy_plan module_search -> measure model
    pipeline: pipeline/ -> model
    stage: stage_plan -> model search pipeline
    budget: auto_policy -> model search stage
    command: __main__ node command/ -> measure model search pipeline

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
