"""A pipeline stage's peak with several passes in flight, the one model the planner per
stage (``pipeline.py``) and a memory budget inside a stage (``auto_policy.py``) share; and
the plan of a stage for a budget: a per-layer policy for ``n`` forward passes in flight,
and how many of them keep it (``keep_passes``), the others moved whole.

NOTE [A stage's passes in flight]
    A stage holds, beside the pass whose forward or backward runs, what the other passes
    in flight keep while they wait.  Memory moves only at a layer boundary of the compute
    stream, so a stage's peak does not depend on timing: :func:`stage_peak` walks the
    stage's order of forwards and backwards, and at each action adds the most the acting
    pass holds during it to what the other passes hold, as :class:`PassBytes` says for a
    pass of each policy:

    - a pass that keeps the per-layer policy (the event model's row of one pass,
      ``schedule_model.py``): its forward's and its backward's most, and while it waits
      what its forward ends with (``eof``);
    - a pass moved whole (NOTE [Moving a pass whole] in engine/pass_schedule.py): in its
      forward, layers ``j`` and ``j - 1`` whole (``whole``: every byte it saved, a
      checkpointed layer its inputs) beside what cannot move of the layers below
      (``stays``); while it waits, ``stays``; brought back (when an older pass's
      backward starts and its place in the queue drops below ``N``), its last layer
      whole too; in its backward, at layer ``j``, layers ``j`` and ``j - 1`` whole
      (``j - 1`` being reloaded) beside ``stays`` below.
    - ZB-V's split backward (NOTE [A backward in two phases] in engine/weight_pass.py):
      ``I`` runs as a backward of the pass's policy, but the retained graph keeps what
      stays of the layers it passed; from its end to ``W`` the pass holds what stays
      and the first layer ``W`` reloads; in ``W``, two layers of what it moved at most
      (one reloaded, the next reloading) beside what stays.

    The planner per stage walks each rank's own order; inside a stage, where only the
    passes in flight are measured, the walk is of the order that holds them longest (all
    ``n`` forwards, then the backwards: GPipe's), with a per-layer policy's single-pass
    peak for both its forward and its backward.

    A moved pass's copies run behind its own forward and the backward before it; inside a
    stage, the step of a moved pass is the per-layer policy's plus what of each layer's
    copy its forward (device to host) does not cover, and of each layer's reload the
    backward it runs behind (the last layer's: the older pass's backward; layer
    ``j - 1``'s: layer ``j``'s) does not, and ``(n - N) / n`` of the passes are moved.
    The host holds what every pass moves: ``n`` times the policy's per-pass bytes, or
    ``N`` times them plus ``(n - N) * (whole - stays)``.  Of every candidate the search
    knows and every ``N``, the fastest that fits the budget (and the host cap) is
    chosen, with the search's own order (``many_policies.order``); with one pass in flight
    the search's own answer is the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine.host_buffers import pool_reserve
from ..policy.policy import POLICY_CHOICES
from .many_policies import order
from .policy_plan import PolicyPlan
from .policy_search import PolicySearch, host_fits
from .schedule_model import PlanRow, simulate_policy

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INPUT",
    "WEIGHT",
    "Action",
    "PassBytes",
    "choose_for_stage",
    "fifo_order",
    "kept_pass",
    "moved_pass",
    "stage_peak",
    "stage_rows",
]

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


@dataclasses.dataclass(frozen=True)
class PassBytes:
    """What one pass holds on the device in each phase (NOTE [A stage's passes in
    flight]): ints, or arrays with one entry per candidate policy.

    Attributes:
        forward: the most during its forward.
        waiting: while it waits for its backward.
        back: while it waits, brought back (a moved pass: its last layer reloaded).
        backward: the most during its backward.
        split: from the end of ZB-V's ``I`` to its ``W``.
        input: the most during ZB-V's ``I`` (its backward, the graph retained).
        weight: the most during ZB-V's ``W``.
    """

    forward: Any
    waiting: Any
    back: Any
    backward: Any
    split: Any
    input: Any = None
    weight: Any = None


def kept_pass(row: PlanRow, input: Any = None, split: Any = None, weight: Any = None) -> PassBytes:
    """A pass that keeps a per-layer policy, from the event model's row of one pass
    (:func:`simulate_policy` with its log); ``input``, ``split``, ``weight``: what it
    holds in ZB-V's split backward (``pipeline.split_bytes``)."""
    forward = max((held for step, _, held in row.log if step.startswith("fwd")), default=0)
    backward = max((held for step, _, held in row.log if step.startswith("bwd")), default=0)
    eof = row.end_of_forward_bytes
    return PassBytes(forward, eof, eof, backward, split, input, weight)


def moved_pass(whole: Any, stays: Any, split: tuple[Any, Any, Any] | None = None) -> PassBytes:
    """A pass moved whole, from each layer's ``whole`` and ``stays`` bytes (one row per
    layer's bytes, or one row per candidate policy and a column per layer); ``split``:
    what it holds in ZB-V's split backward (``input``, ``split``, ``weight``)."""
    whole, stays = np.atleast_2d(whole), np.atleast_2d(stays)
    layers = whole.shape[1]
    below = np.concatenate([np.zeros_like(stays[:, :1]), np.cumsum(stays, axis=1)], axis=1)
    # at layer j (forward or backward): j and j - 1 whole, the layers below staying
    at = [
        below[:, max(j - 1, 0)] + (whole[:, j - 1] if j >= 1 else 0) + whole[:, j]
        for j in range(layers)
    ]
    forward = np.max(np.stack([below[:, layers], *at[:-1]]), axis=0)
    backward = np.max(np.stack(at), axis=0)
    back = below[:, layers] - stays[:, -1] + whole[:, -1]
    squeeze = (lambda x: x) if whole.shape[0] > 1 else (lambda x: int(x[0]))
    input, held, weight = split if split is not None else (None, None, None)
    return PassBytes(
        squeeze(forward),
        squeeze(below[:, layers]),
        squeeze(back),
        squeeze(backward),
        split=held,
        input=input,
        weight=weight,
    )


@dataclasses.dataclass
class _Held:
    whole: bool
    held: Any
    started: bool = False
    back: bool = False


def stage_peak(
    order: Sequence[Action], kept: PassBytes, moved: PassBytes, keep_passes: int | None
) -> Any:
    """The most a stage's passes hold on the device at once as it runs ``order``, each
    pass keeping the per-layer policy (``kept``) or, beyond the ``keep_passes`` whose
    backwards come next, moved whole (``moved``); NOTE [A stage's passes in flight]."""
    passes: dict[tuple[int, int], _Held] = {}
    peak: Any = 0

    def queue(chunk: int) -> list[_Held]:
        return [p for k, p in passes.items() if k[0] == chunk and not p.started]

    for action in order:
        key = (action.chunk, action.microbatch)
        if action.kind == FORWARD:
            whole = keep_passes is not None and len(queue(action.chunk)) >= keep_passes
            own = moved if whole else kept
            peak = np.maximum(peak, sum(p.held for p in passes.values()) + own.forward)
            passes[key] = _Held(whole, own.waiting)
        elif action.kind == WEIGHT:
            state = passes.pop(key)
            own = moved if state.whole else kept
            peak = np.maximum(peak, sum(p.held for p in passes.values()) + own.weight)
        else:
            state = passes[key]
            state.started, state.held = True, 0
            for other in queue(action.chunk)[: keep_passes or 0]:
                if other.whole and not other.back:
                    other.back, other.held = True, moved.back
            own = moved if state.whole else kept
            during = own.input if action.kind == INPUT else own.backward
            peak = np.maximum(peak, sum(p.held for p in passes.values()) + during)
            if action.kind == INPUT:
                state.held = own.split
            else:
                del passes[key]
    return peak


def stage_rows(
    search: PolicySearch, in_flight: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate and ``keep_passes`` (None, then 1..n-1): the candidate's row in
    ``search.codes``, ``keep_passes`` (0 for None), the stage's peak, step time per pass
    and host bytes (NOTE [A stage's passes in flight])."""
    codes, results, costs = search.codes, search.results, search.costs
    n = max(1, in_flight)
    checkpointed = search.checkpointed(codes)
    saved = np.array([c.saved_bytes for c in costs])[None, :]
    inputs = np.array([c.input_bytes for c in costs])[None, :]
    kept = np.array([c.kept_bytes for c in costs])[None, :]
    inputs_kept = inputs - np.array([c.input_offloaded_bytes for c in costs])[None, :]
    whole = np.where(checkpointed, inputs, saved)
    stays = np.where(checkpointed, inputs_kept, kept)
    forward_s = sum(c.forward_s for c in costs)
    backward_s = np.maximum(results.step_s - forward_s, 0.0)
    moved = (whole - stays).sum(axis=1)
    layer_back = np.array([c.backward_s for c in costs])
    behind = np.concatenate([layer_back[1:], [0.0]])[None, :]  # layer j - 1 behind j
    reloads = (whole - stays) / search.h2d
    exposed = np.maximum(moved / search.d2h - forward_s, 0.0)
    exposed += np.maximum(reloads[:, -1] - backward_s, 0.0)  # behind the older backward
    exposed += np.maximum(reloads[:, :-1] - behind[:, :-1], 0.0).sum(axis=1)
    peak = results.peak_bytes
    per_layer = PassBytes(
        peak, results.end_of_forward_bytes, results.end_of_forward_bytes, peak, None
    )
    moved_whole = moved_pass(whole, stays)
    fifo = fifo_order(n)
    rows, keeps, peaks, steps, hosts = [], [], [], [], []
    candidates = np.arange(len(codes))
    for keep in range(n):  # 0: every pass keeps the policy
        rows.append(candidates)
        keeps.append(np.full(len(codes), keep))
        peaks.append(
            np.broadcast_to(stage_peak(fifo, per_layer, moved_whole, keep or None), len(codes))
        )
        if keep == 0:
            steps.append(results.step_s)
            hosts.append(n * results.offloaded_bytes)
        else:
            steps.append(results.step_s + (n - keep) / n * exposed)
            hosts.append(keep * results.offloaded_bytes + (n - keep) * moved)
    return tuple(np.concatenate(x) for x in (rows, keeps, peaks, steps, hosts))  # type: ignore[return-value]


def choose_for_stage(
    search: PolicySearch, memory_budget: int, host_cap: int | None, in_flight: int
) -> PolicyPlan:
    """The plan of a stage with ``in_flight`` passes in flight: the fastest per-layer
    policy and ``keep_passes`` whose peak fits ``memory_budget`` (NOTE [A stage's passes
    in flight]); its ``predicted`` row is the stage's (peak, step per pass)."""
    if in_flight <= 1:
        plan = search.choose(memory_budget, host_cap)
        plan.in_flight = 1
        return plan
    rows, keeps, peaks, steps, hosts = stage_rows(search, in_flight)
    checkpoints = search.checkpoints[rows]
    ranked = order(peaks, steps, hosts, checkpoints, memory_budget, host_fits(hosts, host_cap))
    best = int(ranked[0])
    policy = [POLICY_CHOICES[code] for code in search.codes[rows[best]]]
    row = simulate_policy(policy, search.costs, search.d2h, search.h2d)
    base = row.step_s / (1 + row.overhead) if row.overhead > -1 else row.step_s
    step = float(steps[best])
    predicted = dataclasses.replace(
        row,
        peak_bytes=int(peaks[best]),
        step_s=step,
        overhead=step / base - 1 if base > 0 else 0.0,
        offloaded_bytes=int(hosts[best]) // in_flight,
    )
    fits = bool(peaks[best] <= memory_budget) and (
        host_cap is None or bool(pool_reserve(int(hosts[best])) <= host_cap)
    )
    keep = int(keeps[best])
    return PolicyPlan(
        policy,
        fits,
        predicted,
        memory_budget,
        len(rows),
        search.checkpoint_refused,
        search.costs,
        search.layer_names,
        "" if fits else _why(int(peaks[best]), memory_budget, in_flight),
        host_cap,
        int(pool_reserve(int(hosts[best]))),
        "" if fits else "memory_budget",
        in_flight=in_flight,
        keep_passes=keep or None,
    )


def _why(peak: int, budget: int, in_flight: int) -> str:
    from ..policy.memory_budget import size

    return (
        f"why nothing fits: with {in_flight} forward passes in flight on this stage the "
        f"closest plan (one pass kept, the others moved whole, where that is smaller) "
        f"peaks at {size(peak)}, above the budget of {size(budget)}: the pass whose "
        "backward runs (two of its layers at least) and the last layer of the one brought "
        "back for the next are on the device together."
    )
