"""The plan of a pipeline stage: a per-layer policy for ``n`` forward passes in flight, and
how many of them keep it (``keep_passes``), the others moved whole.

NOTE [A stage's passes in flight]
    A stage whose schedule keeps ``n`` passes in flight (1F1B on stage ``s`` of ``p``:
    ``p - s``) holds, beside the pass whose backward runs, the other passes' saved
    activations.  For a per-layer policy ``P`` (the event model's row: ``peak``, the end
    of forward ``eof``, the step time) and ``keep_passes=N``:

    - every pass keeps ``P`` (``N >= n``, or None): ``peak + (n - 1) * eof``;
    - ``N < n``: a moved pass comes back whole (``whole``: every layer, a checkpointed
      one its inputs) when it moves up to position ``N - 1``, and holds that until its
      own backward starts; the ``n - N - 1`` moved passes that wait hold what cannot
      move (``stays``).  At the first backward the ``N - 1`` kept passes that wait hold
      ``eof`` each beside one pass brought back: ``peak + (N - 1) * eof + whole``; once
      the passes in backward are passes brought back, the one in backward and the ``N``
      that wait are whole: ``(N + 1) * whole``.  The stage's peak is the larger, plus
      ``(n - N - 1) * stays`` (NOTE [Moving a pass whole] in engine/pass_schedule.py).

    A moved pass's copies run behind its own forward and the backward before it; the
    step of a moved pass is ``P``'s plus what of ``(whole - stays) / link`` its forward
    (device to host) and its backward (host to device) do not cover, and ``(n - N) / n``
    of the passes are moved.  The host holds what every pass moves: ``n`` times ``P``'s
    per-pass bytes, or ``N`` times them plus ``(n - N) * (whole - stays)``.  Of every
    candidate the search knows and every ``N``, the fastest that fits the budget (and
    the host cap) is chosen, with the search's own order (``local_search.order``); with
    one pass in flight the search's own answer is the plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..engine.host_buffers import pool_reserve
from ..policy.policy import POLICY_CHOICES
from .local_search import order
from .policy_plan import PolicyPlan
from .policy_search import PolicySearch, host_fits
from .schedule_model import simulate_policy

__all__ = ["choose_for_stage", "stage_rows"]


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
    whole = np.where(checkpointed, inputs, saved).sum(axis=1)
    stays = np.where(checkpointed, inputs_kept, kept).sum(axis=1)
    forward_s = sum(c.forward_s for c in costs)
    backward_s = np.maximum(results.step_s - forward_s, 0.0)
    moved = whole - stays
    exposed = np.maximum(moved / search.d2h - forward_s, 0.0) + np.maximum(
        moved / search.h2d - backward_s, 0.0
    )
    rows, keeps, peaks, steps, hosts = [], [], [], [], []
    candidates = np.arange(len(codes))
    for keep in range(n):  # 0: every pass keeps the policy
        rows.append(candidates)
        keeps.append(np.full(len(codes), keep))
        if keep == 0:
            peaks.append(results.peak_bytes + (n - 1) * results.end_of_forward_bytes)
            steps.append(results.step_s)
            hosts.append(n * results.offloaded_bytes)
        else:
            eof = results.end_of_forward_bytes
            first = results.peak_bytes + (keep - 1) * eof + whole
            peaks.append(np.maximum(first, (keep + 1) * whole) + (n - keep - 1) * stays)
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
        "backward runs and the one brought back for the next are on the device together."
    )
