"""The per-stage search of the planner: for every rank of a schedule, every policy a
stage may take (the first ``k`` layers of every pass, and ``keep_passes``) run through
the stage model (``stage_model.py``), and the fastest that fits the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...device.profiles import DeviceProfile
from ..schedule_model import LayerCosts, first_k
from .orders import arrivals, in_flight, rank_orders
from .stage_model import StagePolicy, StageRow, simulate_stage

__all__ = [
    "PipelinePlan",
    "StagePlan",
    "candidates",
    "choose",
    "gradient_accumulation_s",
    "plan_pipeline",
]


def gradient_accumulation_s(layer: Any, device: DeviceProfile) -> float:
    """Time to add one micro-batch's parameter gradients of ``layer`` (a module, on the
    meta device) to ``.grad``: one kernel per parameter reading both and writing one."""
    return sum(
        device.kernel_seconds(p.numel(), 3 * p.numel() * p.element_size())
        for p in layer.parameters()
        if p.requires_grad
    )


@dataclass
class StagePlan:
    """The plan of one pipeline stage (rank): its passes in flight, its policy, and the
    same stage without offload and with today's layer-k offload at the same peak.

    Attributes:
        stage: the rank.
        in_flight: the most passes of one of its stages in flight at once.
        policy: the chosen :class:`StagePolicy`.
        predicted: the chosen policy's :class:`StageRow`.
        fits: whether its peak fits the memory budget (True without one).
        without: the stage without offload.
        layer_k: today's offload (the first ``k`` layers of every pass) with the
            smallest ``k`` that reaches the chosen peak, or the smallest peak any ``k``
            reaches; ``layer_k_policy`` its policy.
    """

    stage: int
    in_flight: int
    layers: int
    policy: StagePolicy
    predicted: StageRow
    fits: bool
    without: StageRow
    layer_k_policy: StagePolicy
    layer_k: StageRow

    def to_json(self) -> dict[str, object]:
        """The entry of the plan's JSON ``"stages"`` list."""
        return {
            "stage": self.stage,
            "in_flight": self.in_flight,
            "policy": self.policy.words(self.layers, self.in_flight),
            "keep_passes": self.policy.keep_passes,
            "layer_policy": first_k(self.layers, self.policy.k),
            "predicted_peak_bytes": self.predicted.peak_bytes,
            "predicted_offloaded_bytes": self.predicted.offloaded_bytes,
            "predicted_step_s": self.predicted.step_s,
            "predicted_exposed_copy_s": self.predicted.exposed_copy_s,
            "fits": self.fits,
            "layers": self.layers,
            "passes_moved_whole": self.predicted.passes_moved_whole,
            "without_offload": {
                "peak_bytes": self.without.peak_bytes,
                "step_s": self.without.step_s,
            },
            "layer_k": {
                "k": self.layer_k_policy.k,
                "peak_bytes": self.layer_k.peak_bytes,
                "step_s": self.layer_k.step_s,
            },
        }


@dataclass
class PipelinePlan:
    """Every stage's plan, and the schedule it came from."""

    schedule: str
    ranks: int
    microbatches: int
    virtual_stages: int
    layers_per_stage: int
    memory_budget: int | None
    overhead_budget: float
    stages: list[StagePlan]


def candidates(layers: int, in_flight_passes: int) -> list[StagePolicy]:
    """The policies a stage may take: the first ``k`` layers of every pass (today's), and
    ``keep_passes = N`` (1 .. in flight - 1) with the first ``k`` of the kept passes."""
    found = [StagePolicy(k) for k in range(layers)]
    for keep in range(1, in_flight_passes):
        found += [StagePolicy(k, keep) for k in range(layers)]
    return found


def choose(
    rows: dict[StagePolicy, StageRow], memory_budget: int | None, overhead_budget: float
) -> tuple[StagePolicy, bool]:
    """The fastest policy that fits the budget (the smaller peak on a tie); without a
    budget, the smallest peak within ``overhead_budget`` of the step without offload.
    Nothing fits: the smallest peak, and False."""
    if memory_budget is None:
        base = rows[StagePolicy(0)].step_s
        within = [p for p, r in rows.items() if r.step_s <= base * (1 + overhead_budget)]
        return min(within, key=lambda p: (rows[p].peak_bytes, rows[p].step_s)), True
    fitting = [p for p, r in rows.items() if r.peak_bytes <= memory_budget]
    if not fitting:
        return min(rows, key=lambda p: (rows[p].peak_bytes, rows[p].step_s)), False
    return min(fitting, key=lambda p: (rows[p].step_s, rows[p].peak_bytes)), True


def plan_pipeline(
    costs: LayerCosts,
    num_layers: int,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    *,
    ranks: int,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 2,
    memory_budget: int | None = None,
    overhead_budget: float = 0.02,
    pass_offload: bool = True,
    accumulate_s: float = 0.0,
    weight_share: float = 0.5,
) -> PipelinePlan:
    """Plan every stage of ``num_layers`` layers split evenly over ``ranks`` (times the
    stages per rank), for ``schedule``'s order (NOTE [The stage model]); without
    ``pass_offload``, the per-layer policies only (no ``keep_passes``); ``accumulate_s``:
    a stage's time to add a micro-batch's gradients (:func:`gradient_accumulation_s`);
    ``weight_share``: the part of a backward ZB-V's ``W`` runs (the rest is ``I``)."""
    virtual = {"interleaved": virtual_stages, "zbv": 2}.get(schedule, 1)
    if num_layers % (ranks * virtual):
        raise ValueError(
            f"--layers {num_layers}: expected a multiple of the {ranks * virtual} pipeline "
            f"stages ({ranks} ranks x {virtual} stages each), so that each stage has as many"
        )
    layers = num_layers // (ranks * virtual)
    orders = rank_orders(schedule, ranks, microbatches, virtual_stages)
    each = costs.per_layer(layers)
    forward_s, backward_s = sum(c.forward_s for c in each), sum(c.backward_s for c in each)
    ready = arrivals(orders, forward_s, backward_s, accumulate_s, weight_share)
    stages = []
    for rank, order in enumerate(orders):
        count = in_flight(order)
        rows = {
            policy: simulate_stage(
                order,
                ready[rank],
                each,
                layers,
                policy,
                d2h_bytes_per_s,
                h2d_bytes_per_s,
                accumulate_s,
                weight_share,
            )  # fmt: skip
            for policy in candidates(layers, count if pass_offload else 1)
        }
        policy, fits = choose(rows, memory_budget, overhead_budget)
        chosen = rows[policy]
        today = [StagePolicy(k) for k in range(layers)]
        reach = [p for p in today if rows[p].peak_bytes <= chosen.peak_bytes]
        layer_k = reach[0] if reach else min(today, key=lambda p: rows[p].peak_bytes)
        stages.append(
            StagePlan(
                rank,
                count,
                layers,
                policy,
                chosen,
                fits,
                rows[StagePolicy(0)],
                layer_k,
                rows[layer_k],
            )  # fmt: skip
        )
    return PipelinePlan(
        schedule, ranks, microbatches, virtual, layers, memory_budget, overhead_budget, stages
    )
