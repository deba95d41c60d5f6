"""Schedule orders: each pipeline rank's forwards and backwards, from torch's schedule
classes; the passes they keep in flight, and when each action's input arrives in the
schedule without offload.

NOTE [Pipeline schedules as orders of actions]
    A pipeline schedule is, for each rank, an order of forwards and backwards of
    micro-batches (and, with several stages per rank, of which of its stages).  The
    orders are torch's own: :func:`rank_orders` builds ``torch.distributed.pipelining``'s
    schedule classes without a process group (the class's ``__new__`` and the few
    attributes its order needs: the number of ranks and micro-batches, the stages per
    rank and the rounds of the interleaved schedule) and asks each for its per-rank
    order (``Schedule1F1B`` and ``ScheduleGPipe``: ``_get_pipeline_order``;
    ``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble``:
    ``_calculate_single_rank_operations``), except ``Schedule1F1B``, whose order is read
    from the loop its ``_step_microbatches`` runs (``min(M, P - rank)`` forwards, then a
    backward and a forward in turn; its ``_get_pipeline_order`` is a drawing that starts
    the last rank at micro-batch 1).  A rank's passes in flight are those whose
    forward ran and whose backward has not finished; with several stages per rank (the
    interleaved schedule, ZB-V) each stage's pass counts apart (a pass of that stage's
    layers).  In ZB-V the backward is split in two, ``I`` (input gradients) and ``W``
    (weight gradients, ``weight_share`` of the backward's time: half unless measured):
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INPUT",
    "SCHEDULES",
    "WEIGHT",
    "Action",
    "arrivals",
    "durations",
    "fifo_order",
    "in_flight",
    "rank_orders",
    "shape_error",
]

#: the kinds of action: a forward, a backward; ZB-V's input and weight gradients
FORWARD, BACKWARD, INPUT, WEIGHT = "F", "B", "I", "W"


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a rank's order: ``kind`` (``F``, ``B``; ZB-V's ``I`` and ``W``) of
    micro-batch ``microbatch`` at the pipeline's stage ``stage``, the rank's ``chunk``-th
    stage (0 with one stage per rank)."""

    kind: str
    microbatch: int
    stage: int
    chunk: int


def fifo_order(passes: int) -> list[Action]:
    """``passes`` forwards, then their backwards in the same order (GPipe's order of one
    stage): the order that keeps them in flight longest."""
    return [Action(kind, m, 0, 0) for kind in (FORWARD, BACKWARD) for m in range(passes)]


#: the schedules ``--schedule`` names, and torch's class of each
SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}


def _torch_orders(schedule: str, ranks: int, microbatches: int, virtual: int) -> dict:
    """Each rank's order of torch's actions (NOTE [Pipeline schedules as orders of
    actions])."""
    from torch.distributed.pipelining import schedules

    if schedule == "1f1b":
        return {rank: _one_f_one_b(rank, ranks, microbatches) for rank in range(ranks)}
    cls = getattr(schedules, SCHEDULES[schedule])
    built = cls.__new__(cls)
    built._n_microbatches = microbatches
    if schedule == "gpipe":
        built._num_stages = ranks
        return dict(built._get_pipeline_order())
    built.pp_group_size = ranks
    if schedule == "interleaved":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise ValueError(
                f"--schedule interleaved: {microbatches} micro-batches over {ranks} stages "
                f"make {rounds} rounds; expected a multiple of {rounds} micro-batches"
            )
        built.n_local_stages = virtual
        built.number_of_rounds, built.microbatches_per_round = rounds, microbatches // rounds
    else:
        built.num_stages = 2 * ranks
    return {rank: built._calculate_single_rank_operations(rank) for rank in range(ranks)}


def _one_f_one_b(rank: int, ranks: int, microbatches: int) -> list:
    """``Schedule1F1B``'s order as its ``_step_microbatches`` runs it: ``min(M, P - rank)``
    forwards, then a backward and a forward in turn (its ``_get_pipeline_order``, a
    drawing, starts the last rank at micro-batch 1)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    warmup = min(microbatches, ranks - rank)
    order = [_Action(rank, forward, m) for m in range(warmup)]
    for m in range(microbatches):
        order.append(_Action(rank, backward, m))
        if warmup + m < microbatches:
            order.append(_Action(rank, forward, warmup + m))
    return order


def rank_orders(
    schedule: str, ranks: int, microbatches: int, virtual_stages: int = 2
) -> list[list[Action]]:
    """Each rank's forwards and backwards in the order ``schedule`` runs them, from
    torch's schedule classes (NOTE [Pipeline schedules as orders of actions]).

    Args:
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved"`` or ``"zbv"``.
        ranks: pipeline ranks (``--pipeline-stages``).
        microbatches: micro-batches per step.
        virtual_stages: stages per rank of the interleaved schedule (ZB-V has 2).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"rank_orders: unknown schedule {schedule!r}; use one of {SCHEDULES}.")
    virtual = {"interleaved": virtual_stages, "zbv": 2}.get(schedule, 1)
    kinds = {"F": FORWARD, "B": BACKWARD, "I": INPUT, "W": WEIGHT}
    orders = []
    for rank, actions in sorted(_torch_orders(schedule, ranks, microbatches, virtual).items()):
        steps = [a for a in actions if a is not None and a.computation_type.value in kinds]
        local = sorted({a.stage_index for a in steps})
        orders.append(
            [
                Action(
                    kinds[a.computation_type.value],
                    a.microbatch_index,
                    a.stage_index,
                    local.index(a.stage_index),
                )
                for a in steps
            ]
        )
        if len(local) != virtual:
            raise ValueError(
                f"rank_orders: rank {rank} of {schedule} runs stages {local}, expected "
                f"{virtual}; please report this bug"
            )
    return orders


def shape_error(layers: int, ranks: int, per_rank: int, schedule: str, microbatches: int) -> str:
    """Why ``layers`` over ``ranks`` x ``per_rank`` stages and ``microbatches`` is not a
    pipeline the schedule runs (``""``: it is), as the commands say it."""
    stages = ranks * per_rank
    if layers % stages or layers < stages:
        return (
            f"--layers {layers}: expected a multiple of the pipeline's {stages} stages "
            f"(--pipeline-stages {ranks}, {per_rank} per rank), so that every stage has as "
            "many layers"
        )
    rounds = max(1, microbatches // ranks)
    if schedule == "interleaved" and microbatches % rounds:
        return (
            f"--microbatches {microbatches}: the interleaved schedule runs {rounds} rounds "
            f"over {ranks} ranks; expected a multiple of {rounds}"
        )
    return ""


def in_flight(order: Sequence[Action]) -> int:
    """The most passes of one of the rank's stages in flight at once: forwarded, and
    not yet through their backward (``W`` in ZB-V)."""
    last = WEIGHT if any(a.kind == WEIGHT for a in order) else None
    live: dict[int, int] = {}
    most = 0
    for action in order:
        if action.kind == FORWARD:
            live[action.chunk] = live.get(action.chunk, 0) + 1
            most = max(most, live[action.chunk])
        elif action.kind == (last or BACKWARD) or (last is None and action.kind == INPUT):
            live[action.chunk] -= 1
    return most


def durations(
    action: Action,
    forward_s: float,
    backward_s: float,
    accumulate_s: float = 0.0,
    weight_share: float = 0.5,
) -> float:
    """An action's compute time, from its stage's forward and backward, and the time to
    add its gradients to those of the micro-batches before (the first's are stored);
    ``weight_share``: the part of a backward ZB-V's ``W`` runs (the rest is ``I``)."""
    if action.kind == FORWARD:
        return forward_s
    added = accumulate_s if action.microbatch > 0 and action.kind != INPUT else 0.0
    share = {BACKWARD: 1.0, INPUT: 1 - weight_share, WEIGHT: weight_share}[action.kind]
    return backward_s * share + added


def arrivals(
    orders: Sequence[Sequence[Action]],
    forward_s: float,
    backward_s: float,
    accumulate_s: float = 0.0,
    weight_share: float = 0.5,
) -> list[list[float]]:
    """When each action's input arrives, in the schedule without offload (NOTE [The
    stage model]): per rank, one time per action of its order (0 where it needs none).
    ``accumulate_s``: a stage's time to add a micro-batch's gradients (after the first);
    ``weight_share``: the part of a backward ZB-V's ``W`` runs."""
    last_stage = max(a.stage for order in orders for a in order)
    ends: dict[tuple[str, int, int], float] = {}
    ready: list[list[float]] = [[0.0] * len(order) for order in orders]
    position, clock = [0] * len(orders), [0.0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                need = _needs(action, last_stage)
                if need is not None and need not in ends:
                    break
                arrival = ends[need] if need is not None else 0.0
                ready[rank][position[rank]] = arrival
                start = max(clock[rank], arrival)
                clock[rank] = start + durations(
                    action, forward_s, backward_s, accumulate_s, weight_share
                )
                kind = BACKWARD if action.kind == INPUT else action.kind
                ends[(kind, action.microbatch, action.stage)] = clock[rank]
                position[rank] += 1
                progressed = True
    if any(p < len(order) for p, order in zip(position, orders, strict=True)):
        raise ValueError("arrivals: the orders wait on one another; please report this bug")
    return ready


def _needs(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    """The action whose end an action's input waits for (None: the pipeline's input)."""
    if action.kind == FORWARD:
        return None if action.stage == 0 else (FORWARD, action.microbatch, action.stage - 1)
    if action.kind == WEIGHT:
        return None  # after its own I, on the same rank
    if action.stage == last_stage:
        return (FORWARD, action.microbatch, action.stage)
    return (BACKWARD, action.microbatch, action.stage + 1)
