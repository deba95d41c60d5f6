"""The plan of a pipeline stage for a memory budget inside it (``auto_policy.py``): a
per-layer policy for ``n`` forward passes in flight, and how many of them keep it
(``keep_passes``), the others moved whole.  Its peak is the stage model's
(:func:`~cpu_offload.plan.pipeline.stage_model.stage_peak`, the one the planner per stage
uses); this module searches every candidate policy and ``N`` with it.

NOTE [A budget inside a stage]
    A memory budget inside a stage measures only how many passes are in flight (NOTE [A
    stage's passes in flight] in ``plan/pipeline/stage_model.py``).  The planner per
    stage walks each rank's own order; inside a stage the walk is of the order that
    holds the passes longest (all ``n`` forwards, then the backwards: GPipe's,
    ``fifo_order``), with a per-layer policy's single-pass peak for both its forward and
    its backward.

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

import numpy as np

from ..engine.host_buffers import pool_reserve
from ..policy.policy import POLICY_CHOICES
from .many_policies import order
from .pipeline.orders import BACKWARD, FORWARD, INPUT, WEIGHT, Action, fifo_order
from .pipeline.stage_model import PassBytes, kept_pass, moved_pass, stage_peak
from .policy_plan import PolicyPlan
from .policy_search import PolicySearch, host_fits
from .schedule_model import simulate_policy

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


def stage_rows(
    search: PolicySearch, in_flight: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate and ``keep_passes`` (None, then 1..n-1): the candidate's row in
    ``search.codes``, ``keep_passes`` (0 for None), the stage's peak, step time per pass
    and host bytes (NOTE [A budget inside a stage])."""
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
    policy and ``keep_passes`` whose peak fits ``memory_budget`` (NOTE [A budget
    inside a stage]); its ``predicted`` row is the stage's (peak, step per pass)."""
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
