"""What the command writes: the plan as JSON (``--json``) and its plot (``--plot``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from ...policy.policy import CHECKPOINT, CHECKPOINT_OFFLOAD, KEEP, OFFLOAD
from ..node import Node
from ..pipeline.search import PipelinePlan
from ..planner import Plan
from ..policy_search import PolicyPlan
from .tables import answer_bytes, budget_text

__all__ = ["POLICY_COLOURS", "draw_policy", "policy_json", "stages_json", "to_json", "write_plot"]

GIB = 2**30


def to_json(plan: Plan, description: str, node: Node | None = None) -> dict[str, object]:
    node = node or Node()
    layer = dataclasses.asdict(plan.layer)
    for measured in (layer, layer["following"]):
        if measured is not None:  # the long lists stay out: their totals are there
            for key in (
                "saved",
                "forward_kernels",
                "backward_kernels",
                "recompute_kernels",
                "saved_by_module",
                "saved_by_kind",
                "forward_sites",
                "offloaded_unpacks",
            ):
                measured.pop(key)
    document: dict[str, object] = {
        "description": description,
        "layer": layer,
        "device": dataclasses.asdict(plan.device),
        "num_layers": plan.num_layers,
        "predicted": True,
        "rows": [
            {"k": row.k}
            | {
                key: value
                for key, value in dataclasses.asdict(row).items()
                if key not in ("log", "offloaded_layers")
            }
            | node.to_json(row.offloaded_bytes)
            for row in plan.rows
        ],
        "ranks_per_node": node.ranks,
        "host_memory_bytes": node.host_memory,
        **node.to_json(answer_bytes(plan)),
        "largest_hidden_k": plan.largest_hidden_k,
        "overhead_budget": plan.overhead_budget,
        "memory_budget": plan.memory_budget,
        "smallest_fitting_k": plan.smallest_fitting_k,
        "needs_checkpointing": plan.needs_checkpointing,
    } | (policy_json(plan.policy) if plan.policy is not None else {})
    return graph_json(plan, document, node) if plan.cuda_graph else document


def graph_json(plan: Plan, document: dict[str, object], node: Node) -> dict[str, object]:
    """The plan of a captured step (NOTE [Planning a captured step] in planner.py): its
    ``cuda_graph`` and the launch of a replay, and per row (and for the policy) the
    device bytes the graph's pool holds and the pinned host bytes it keeps, both for
    the graph's life."""
    rows = cast(list[dict[str, object]], document["rows"])
    for entry, row in zip(rows, plan.rows):
        entry |= held_json(row.peak_bytes, row.offloaded_bytes, node)
    if plan.policy is not None:
        predicted = cast(dict[str, object], document["policy_predicted"])
        row = plan.policy.predicted
        predicted |= held_json(row.peak_bytes, row.offloaded_bytes, node)
    return document | {"cuda_graph": True, "graph_launch_s": plan.graph_launch_s}


def held_json(peak_bytes: int, offloaded_bytes: int, node: Node) -> dict[str, int]:
    """What a captured step holds between replays: ``graph_pool_bytes`` (its peak,
    in the graph's private pool) and ``graph_host_bytes`` (its pinned buffers)."""
    return {"graph_pool_bytes": peak_bytes, "graph_host_bytes": node.per_rank(offloaded_bytes)}


def policy_json(choice: PolicyPlan) -> dict[str, object]:
    row = choice.predicted
    return {
        "policy": choice.policy,
        "policy_fits": choice.fits,
        "policy_checkpoint_refused": choice.checkpoint_refused,
        "policy_binding": choice.binding,
        "policy_predicted": {
            "end_of_forward_bytes": row.end_of_forward_bytes,
            "peak_bytes": row.peak_bytes,
            "offloaded_bytes_per_step": row.offloaded_bytes,
            "step_time_s": row.step_s,
            "overhead": row.overhead,
            "recompute_s": row.recompute_s,
            "exposed_copy_s": row.exposed_copy_s,
        },
    }


def stages_json(plan: PipelinePlan) -> dict[str, object]:
    """The JSON's ``"pipeline_schedule"`` and ``"stages"``."""
    return {
        "pipeline_schedule": {
            "schedule": plan.schedule,
            "pipeline_stages": plan.ranks,
            "microbatches": plan.microbatches,
            "stages_per_rank": plan.virtual_stages,
            "layers_per_stage": plan.layers_per_stage,
            "memory_budget_per_stage": plan.memory_budget,
        },
        "stages": [stage.to_json() for stage in plan.stages],
    }


def write_plot(plan: Plan, path: str) -> str | None:
    """Activation memory and predicted overhead against k; why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    ks = [row.k for row in plan.rows]
    if plan.policy is not None:
        figure, (memory, layers) = plt.subplots(
            2, 1, figsize=(7, 5.5), gridspec_kw={"height_ratios": [3, 1]}
        )
        draw_policy(layers, plan.policy.policy)
        layers.set_title(
            f"policy for {budget_text(plan.policy.memory_budget)}"
            + ("" if plan.policy.fits else " (nothing fits: the closest)")
        )
    else:
        figure, memory = plt.subplots(figsize=(7, 4))
    memory.plot(ks, [r.peak_bytes / GIB for r in plan.rows], "o-", label="peak activations")
    memory.set_xlabel("k (layers offloaded)")
    memory.set_ylabel("GiB")
    overhead = memory.twinx()
    overhead.plot(ks, [100 * r.overhead for r in plan.rows], "s--", color="C1")
    overhead.set_ylabel("predicted overhead, %", color="C1")
    captured = ", one CUDA graph" if plan.cuda_graph else ""
    memory.set_title(f"{plan.device.name}, L = {plan.num_layers}{captured} (predicted)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return None


#: a colour per policy choice, in plots
POLICY_COLOURS = {KEEP: "C7", OFFLOAD: "C0", CHECKPOINT: "C1", CHECKPOINT_OFFLOAD: "C2"}


def draw_policy(axes: Any, policy: Sequence[str]) -> None:
    """One coloured cell per layer, a legend of the choices."""
    for index, choice in enumerate(policy):
        axes.barh(0, 1, left=index, color=POLICY_COLOURS[choice], edgecolor="white")
    for choice, colour in POLICY_COLOURS.items():
        axes.barh(0, 0, color=colour, label=choice)
    axes.set_yticks([])
    axes.set_xlim(0, len(policy))
    axes.set_xlabel("layer")
    axes.legend(ncol=4, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.6))
