"""``python -m cpu_offload.plan``: memory and predicted time of every k, on any machine.

The command's rooms are in ``command/``: its flags (``args.py``), what it prints
(``tables.py``) and what it writes (``output.py``); this module runs a mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..device.profiles import DeviceProfile
from .census import LayerProfile, measure_layer
from .command.args import (
    GPT_LAYERS,
    PLAN_PRESETS,
    check_pipeline,
    check_shape_flags,
    layer_spec,
    modules_argument,
    parse,
    parser,
)
from .command.output import (
    POLICY_COLOURS,
    draw_policy,
    policy_json,
    stages_json,
    to_json,
    write_plot,
)
from .command.tables import (
    answer_bytes,
    budget_text,
    host_bytes_per_rank,
    print_answers,
    print_plan,
    print_policy,
    print_saved_by,
    print_stages,
)
from .layers import LayerSpec
from .module_search import ModuleSearch
from .node import Node
from .pipeline import PipelinePlan, gradient_accumulation_s, plan_pipeline
from .planner import plan_offload, replay_profile
from .schedule_model import LayerCosts

__all__ = [  # the command's functions, importable from here as before the split
    "GPT_LAYERS",
    "PLAN_PRESETS",
    "POLICY_COLOURS",
    "answer_bytes",
    "budget_text",
    "check_pipeline",
    "check_shape_flags",
    "draw_policy",
    "host_bytes_per_rank",
    "layer_spec",
    "main",
    "modules_argument",
    "parser",
    "plan_stages",
    "policy_json",
    "print_answers",
    "print_plan",
    "print_policy",
    "print_saved_by",
    "print_stages",
    "stages_json",
    "to_json",
    "write_plot",
]


def plan_stages(
    args: argparse.Namespace,
    spec: LayerSpec,
    profile: LayerProfile,
    device: DeviceProfile,
    layers: int,
) -> PipelinePlan:
    """Every stage's plan (``--pipeline-stages``), printed; ``layers``: one stage's."""
    accumulate_s = layers * gradient_accumulation_s(spec.module(), device)
    stages = plan_pipeline(
        LayerCosts.of(profile, device),
        layers * args.pipeline_stages * args.virtual_stages,
        device.d2h,
        device.h2d,
        ranks=args.pipeline_stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        memory_budget=args.memory_budget,
        overhead_budget=args.overhead,
        accumulate_s=accumulate_s,
    )
    print_stages(stages)
    return stages


def main(argv: Sequence[str] | None = None) -> int:
    cli, args, device, spec, num_layers = parse(argv)
    modules = modules_argument(args.modules) if args.modules else None
    node = Node(args.ranks_per_node, args.host_memory)
    budget = args.memory_budget  # bytes
    per_module = None
    if args.per_module and budget is not None:
        measure = dict(kwargs=spec.kwargs, min_offload_numel=args.min_offload_numel)
        measure |= dict(attention=args.attention, description=spec.description)
        timed = replay_profile(device) if args.cuda_graph else device
        search = ModuleSearch(spec.make_layer, spec.inputs, num_layers, timed, **measure)
        per_module = search.choose(budget)
        print(per_module.summary())
    try:
        profile = (
            per_module.profile
            if per_module and per_module.profile
            else measure_layer(
                spec.make_layer,
                spec.inputs,
                kwargs=spec.kwargs,
                min_offload_numel=args.min_offload_numel,
                attention=args.attention,
                description=spec.description,
                modules=modules,
            )
        )
    except ValueError as error:
        if modules is None:
            raise
        cli.error(f"--modules: {error}")
    if modules is not None:
        print_saved_by(profile)
    stage_budget = None if args.pipeline_stages else budget  # a pipeline's: per stage
    plan = plan_offload(
        profile,
        num_layers,
        device,
        overhead_budget=args.overhead,
        memory_budget=stage_budget,
        host_cap=node.cap_per_rank,
        cuda_graph=args.cuda_graph,
    )
    print_plan(plan, spec.description, node)
    stages = plan_stages(args, spec, profile, device, num_layers) if args.pipeline_stages else None
    if args.json:
        with open(args.json, "w") as file:
            document = to_json(plan, spec.description, node)
            if stages is not None:
                document |= stages_json(stages)
            if per_module is not None:
                document["per_module"] = per_module.to_json()
            json.dump(document, file, indent=2)
    if args.plot:
        why = write_plot(plan, args.plot)
        print(f"plot: {why}" if why else f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
