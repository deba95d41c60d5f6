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

    Its step per pass is the stage model's (:func:`simulate_stage` on ``fifo_order(n)``,
    the candidate's per-layer policy in every kept pass, checkpointed layers
    checkpointed in every pass: :func:`stage_step`).  The search has thousands of
    per-layer candidates times each ``N``, too many to run each through the stage model,
    so a closed form ranks them (:func:`stage_rows`) and the stage model times those
    that can win:

    - Every pass kept: the per-layer policy's step (the event model of one pass).  In
      GPipe's order a pass's copies end with its forward and its reloads run in its own
      backward, so the passes do not share the link: this is the stage model's step.
    - ``keep_passes=N``: ``N / n`` of the passes run the per-layer policy's step; the
      others, moved whole, run without the per-layer offloads: the step without offload,
      a checkpointed layer's recompute, and what of each layer's copy its forward (device
      to host) does not cover and of each layer's reload the backward it runs behind
      (the last layer's: the older pass's backward; layer ``j - 1``'s: layer ``j``'s)
      does not.  This leaves out the link the passes share (their reloads queue on it)
      and that a moved pass's copies also hide behind its neighbours' compute: on the
      stacks of tests/plan/ and four Llama-3-8B layers, from 16% below the stage model
      (5 GB/s, one pass kept) to 7% above it (5 GB/s, every pass but one kept).

    Of the candidates that fit the budget (and the host cap), the best few of each ``N``
    by the closed form are timed by the stage model; then, while the fastest (by the
    stage model where timed, the closed form where not) is not timed, it is timed, and
    so is any that fits whose closed form is within :data:`MARGIN` of the fastest's
    step; at most :data:`MOST_TIMED` in all, after which a candidate not timed is not
    chosen over one that is.  The plan's step is the stage model's.  The stage model
    reloads an offloaded layer whole: with ``reload_slice_bytes`` a kept pass's step is
    the event model's where every pass is kept, the stage model's (whole reloads)
    otherwise.  The host holds what every pass moves: ``n`` times the policy's per-pass
    bytes, or ``N`` times them plus ``(n - N) * (whole - stays)``.  Ties go as the
    search's own order (``many_policies.order``); with one pass in flight the search's
    own answer is the plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..engine.host_buffers import pool_reserve
from ..policy.policy import OFFLOADED, POLICY_CHOICES
from .many_policies import order
from .pipeline.orders import BACKWARD, FORWARD, INPUT, WEIGHT, Action, fifo_order
from .pipeline.stage_model import (
    PassBytes,
    StagePolicy,
    StageRow,
    kept_pass,
    moved_pass,
    simulate_stage,
    stage_peak,
)
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
    "stage_step",
]

#: the most candidates the stage model times for one plan (NOTE [A budget inside a stage])
MOST_TIMED = 48
#: of each ``keep_passes``, the candidates that fit timed first, best by the closed form
TIMED_FIRST = 3
#: a candidate whose closed form is within this of the best one's stage model is timed
MARGIN = 0.1


def stage_rows(
    search: PolicySearch, in_flight: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate and ``keep_passes`` (None, then 1..n-1): the candidate's row in
    ``search.codes``, ``keep_passes`` (0 for None), the stage's peak, step time per pass
    (the closed form, to rank them) and host bytes (NOTE [A budget inside a stage])."""
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
    # a pass moved whole: no per-layer offloads, its checkpointed layers recomputed
    layer_back = np.array([c.backward_s for c in costs])[None, :]
    layer_back = layer_back + checkpointed * np.array([c.recompute for c in costs])[None, :]
    backward_s = layer_back.sum(axis=1)
    whole_step = forward_s + backward_s
    moved = (whole - stays).sum(axis=1)
    behind = layer_back[:, 1:]  # layer j - 1's reload behind layer j's backward
    reloads = (whole - stays) / search.h2d
    exposed = np.maximum(moved / search.d2h - forward_s, 0.0)
    exposed += np.maximum(reloads[:, -1] - backward_s, 0.0)  # behind the older backward
    exposed += np.maximum(reloads[:, :-1] - behind, 0.0).sum(axis=1)
    peak = results.peak_bytes
    per_layer = PassBytes(
        peak, results.end_of_forward_bytes, results.end_of_forward_bytes, peak, None
    )
    moved_whole = moved_pass(whole, stays, running=saved)  # the recompute in backward
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
            steps.append((keep * results.step_s + (n - keep) * (whole_step + exposed)) / n)
            hosts.append(keep * results.offloaded_bytes + (n - keep) * moved)
    return tuple(np.concatenate(x) for x in (rows, keeps, peaks, steps, hosts))  # type: ignore[return-value]


def stage_step(search: PolicySearch, codes: np.ndarray, keep: int, in_flight: int) -> StageRow:
    """The stage model's run of ``in_flight`` passes in GPipe's order (``fifo_order``),
    each kept pass under the candidate ``codes`` (a row of ``search.codes``) and, with
    ``keep`` above 0, every pass but ``keep`` moved whole (NOTE [A budget inside a
    stage]); its ``step_s`` is the whole order's."""
    layers = tuple(POLICY_CHOICES[code] for code in codes)
    policy = StagePolicy(sum(c in OFFLOADED for c in layers), keep or None, layers)
    order = fifo_order(max(1, in_flight))
    return simulate_stage(
        order, [0.0] * len(order), search.costs, len(layers), policy, search.d2h, search.h2d
    )


def _time_candidates(
    search: PolicySearch,
    in_flight: int,
    table: tuple[np.ndarray, ...],
    memory_budget: int,
    host_ok: np.ndarray | None,
) -> tuple[int, np.ndarray, StageRow | None]:
    """The best row of ``table`` (``stage_rows``'s) by the stage model's step, where
    timed (NOTE [A budget inside a stage]); returns it, the steps (the stage model's where
    timed) and the stage model's run of it (None for a row with every pass kept)."""
    rows, keeps, peaks, estimate, hosts = table
    steps = estimate.copy()
    checkpoints = search.checkpoints[rows]
    timed: dict[int, StageRow] = {}

    def time(index: int) -> None:
        run = stage_step(search, search.codes[rows[index]], int(keeps[index]), in_flight)
        timed[index] = run
        steps[index] = run.step_s / in_flight

    fits = peaks <= memory_budget
    if host_ok is not None:
        fits &= host_ok
    # rows not timed keep their place in this ranking: the best now is among the timed,
    # the best with every pass kept and the first keep_passes row not timed yet
    ranked = order(peaks, steps, hosts, checkpoints, memory_budget, host_ok)
    kept_all = ranked[keeps[ranked] == 0][:1]
    moved = iter(ranked[keeps[ranked] > 0])
    for keep in range(1, in_flight):
        for index in ranked[(keeps[ranked] == keep) & fits[ranked]][:TIMED_FIRST]:
            time(int(index))
    following = next(moved, None)

    def best_now() -> int:
        nonlocal following
        while following is not None and int(following) in timed:
            following = next(moved, None)
        rows_now = [*timed, *kept_all]
        if following is not None and (len(timed) < MOST_TIMED or not fits[rows_now].any()):
            rows_now.append(int(following))  # beyond MOST_TIMED, only where none fits
        subset = np.unique(rows_now)
        ok = None if host_ok is None else host_ok[subset]
        return int(subset[order(peaks[subset], steps[subset], hosts[subset],
                                checkpoints[subset], memory_budget, ok)[0]])  # fmt: skip

    while True:
        best = best_now()
        if keeps[best] > 0 and best not in timed:
            time(best)
            continue
        # a fitting candidate whose closed form is close may be faster by the stage model
        close = fits & (keeps > 0) & (steps < steps[best] * (1 + MARGIN))
        close[list(timed)] = False
        if not fits[best] or not close.any() or len(timed) >= MOST_TIMED:
            return best, steps, timed.get(best)
        time(int(np.flatnonzero(close)[np.argmin(steps[close])]))


def choose_for_stage(
    search: PolicySearch, memory_budget: int, host_cap: int | None, in_flight: int
) -> PolicyPlan:
    """The plan of a stage with ``in_flight`` passes in flight: the fastest per-layer
    policy and ``keep_passes`` whose peak fits ``memory_budget`` (NOTE [A budget
    inside a stage]); its ``predicted`` row is the stage's (peak, step per pass: the
    stage model's)."""
    if in_flight <= 1:
        plan = search.choose(memory_budget, host_cap)
        plan.in_flight = 1
        return plan
    table = stage_rows(search, in_flight)
    rows, keeps, peaks, _, hosts = table
    best, steps, run = _time_candidates(
        search, in_flight, table, memory_budget, host_fits(hosts, host_cap)
    )
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
        exposed_copy_s=row.exposed_copy_s if run is None else run.exposed_copy_s / in_flight,
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
