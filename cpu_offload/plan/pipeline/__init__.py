"""The plan per pipeline stage: the passes a schedule keeps in flight, and what to offload.

Its rooms, each importing only those above it:

- ``orders.py``: schedule orders. Each rank's forwards and backwards from torch's
  schedule classes (:func:`rank_orders`, :class:`Action`), the passes they keep in flight
  (:func:`in_flight`) and when each action's input arrives without offload
  (:func:`arrivals`).
- ``stage_clocks.py``: the clocks of one rank running its order with offload (its
  compute stream, copy streams and copy engines; the passes' copies in flight).
- ``stage_model.py``: the stage model. :func:`simulate_stage`, from a rank's order, its
  stage's per-layer bytes and costs and a :class:`StagePolicy`, to the stage's peak and
  step time (:class:`StageRow`); its memory over time is :func:`stage_memory` and its
  peak :func:`stage_peak`, over what a pass holds
  in each phase (:class:`PassBytes`). A memory budget inside a stage
  (``plan/stage_plan.py``) uses the same peak and bytes.
- ``search.py``: the per-stage search. Every policy a stage may take, through the stage
  model, and the fastest that fits (:func:`plan_pipeline`, :class:`PipelinePlan`).

The names stay importable from ``cpu_offload.plan.pipeline`` as before the split.
"""

from __future__ import annotations

from .orders import (
    BACKWARD,
    FORWARD,
    INPUT,
    SCHEDULES,
    WEIGHT,
    Action,
    arrivals,
    durations,
    fifo_order,
    in_flight,
    rank_orders,
    shape_error,
)
from .search import (
    PipelinePlan,
    StagePlan,
    candidates,
    choose,
    gradient_accumulation_s,
    plan_pipeline,
)
from .stage_clocks import weight_chain
from .stage_model import (
    PassBytes,
    StagePolicy,
    StageRow,
    kept_pass,
    moved_pass,
    simulate_stage,
    split_bytes,
    stage_memory,
    stage_passes,
    stage_peak,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INPUT",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "PassBytes",
    "PipelinePlan",
    "StagePlan",
    "StagePolicy",
    "StageRow",
    "arrivals",
    "candidates",
    "choose",
    "durations",
    "fifo_order",
    "gradient_accumulation_s",
    "in_flight",
    "kept_pass",
    "moved_pass",
    "plan_pipeline",
    "rank_orders",
    "shape_error",
    "simulate_stage",
    "split_bytes",
    "stage_memory",
    "stage_passes",
    "stage_peak",
    "weight_chain",
]
