"""The plan per pipeline stage: the passes a schedule keeps in flight, and what to offload.

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
    the pass stays in flight until ``W``.

NOTE [The stage model]
    Each rank runs its order of actions on one compute stream; an action starts when the
    rank's last one ended and its input arrived: the forward of micro-batch ``m`` at
    stage ``s`` after the forward of ``m`` at ``s - 1``, its backward after the backward
    of ``m`` at ``s + 1`` (the last stage's after its own forward).  :func:`arrivals`
    times the schedule without offload from the layers' compute times (sends cost
    nothing); the stage model then runs one rank's actions with offload, each waiting
    for its input's arrival as the schedule without offload times it (the neighbours do
    not slow down with this stage).  Copies run on one copy stream per stage of the rank
    (one offload context each), through one device-to-host and one host-to-device engine.

    A pass runs one of two policies.  *Per layer* (today's): its offloaded layers are
    released and reloaded as the default schedule says (``schedule_model.py``).  *Moved
    whole* (``keep_passes=N``; ``N`` or more older passes of its stage wait for their
    backward when its forward starts), as the engine runs it (NOTE [Moving a pass whole]
    in ``engine/pass_schedule.py``): at the forward of layer ``j`` the copy of layer
    ``j - 1`` starts and layer ``j - 2`` is released (the compute stream waits for its
    copy), and as the forward ends the last layer's copy starts and the last two layers
    are released; when the backward of an older pass starts and the pass's place in the
    queue drops below ``N``, its last layer's reload starts (a pass whose own backward
    comes first starts it then, on demand), and as its backward reaches layer ``j`` the
    reload of layer ``j - 1`` starts; its backward waits for each layer's reload.  Its
    copies to the host hide behind the other passes' compute (a pass ``p`` places behind
    the oldest waits about ``in_flight - p`` micro-batch slots for its backward), its
    reloads behind the older pass's backward and its own layers' backwards.

    ZB-V's ``I`` runs as a backward of the pass's policy; as it ends, the reload of the
    first layer ``W`` needs starts (the first of the pass's moved layers: torch's ``W``
    goes from the first layer up), and in ``W`` the first unpack of a moved layer starts
    the next one's reload and waits for its own (NOTE [A backward in two phases] in
    ``engine/weight_pass.py``): ``W`` reloads everything the pass moved a second time,
    its first layer exposed where ``W`` follows ``I`` at once.

    The stage's peak is the model of NOTE [A stage's passes in flight] in
    ``stage_plan.py`` (:func:`stage_peak`), walked over the rank's order: memory moves
    only at layer boundaries, so the clocks above do not change it.

Every figure is a prediction; memory is the layers' saved activations only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..device.profiles import DeviceProfile
from ..engine.schedule import schedule_points
from ..report.policy_words import describe_policy, pass_policy_words
from .schedule_model import LayerCosts, first_k, simulate_policy
from .stage_plan import (
    BACKWARD,
    FORWARD,
    INPUT,
    WEIGHT,
    Action,
    kept_pass,
    moved_pass,
    stage_peak,
)

__all__ = [
    "shape_error",
    "SCHEDULES",
    "Action",
    "PipelinePlan",
    "StagePlan",
    "StagePolicy",
    "StageRow",
    "arrivals",
    "gradient_accumulation_s",
    "in_flight",
    "plan_pipeline",
    "rank_orders",
    "simulate_stage",
]

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


def gradient_accumulation_s(layer: Any, device: DeviceProfile) -> float:
    """Time to add one micro-batch's parameter gradients of ``layer`` (a module, on the
    meta device) to ``.grad``: one kernel per parameter reading both and writing one."""
    return sum(
        device.kernel_seconds(p.numel(), 3 * p.numel() * p.element_size())
        for p in layer.parameters()
        if p.requires_grad
    )


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


@dataclass(frozen=True)
class StagePolicy:
    """What a stage does: ``k`` layers of each kept pass offloaded per layer (the
    default schedule's first ``k``), and with ``keep_passes`` set, every pass but the
    ``keep_passes`` oldest in flight moved whole."""

    k: int
    keep_passes: int | None = None

    def words(self, layers: int, in_flight: int | None = None) -> str:
        """The policy in words, as the step report and the handle say it: ``"layers 0-1
        offload, 2-3 keep; keep 1 pass, 3 of 4 moved whole"``."""
        text = f"layers {describe_policy(first_k(layers, self.k))}"
        if self.keep_passes is not None:
            text += f"; {pass_policy_words(self.keep_passes, in_flight)}"
        return text


@dataclass
class StageRow:
    """The stage model's prediction for one stage and policy (bytes, seconds).

    Attributes:
        peak_bytes: the most saved activations on the device at a layer boundary.
        offloaded_bytes: bytes copied to the host per step (and back).
        step_s: when the stage's last action ends, from the step's start.
        exposed_copy_s: time the compute stream waited for copies.
        waited_s: time it waited for its inputs (the neighbours).
        passes_moved_whole: passes the policy moved whole.
    """

    peak_bytes: int
    offloaded_bytes: int
    step_s: float
    exposed_copy_s: float
    waited_s: float
    passes_moved_whole: int


class _Pass:
    """One pass's copies in flight."""

    def __init__(self, costs: list[LayerCosts], whole: bool, policy: list[str]) -> None:
        self.whole = whole
        self.copy_done: dict[int, float] = {}
        self.reload_done: dict[int, float] = {}
        offloaded = [j for j, c in enumerate(policy) if c != "keep"]
        self.points = {} if whole else schedule_points(len(costs), offloaded)
        #: the layers ZB-V's W reloads, in its order (NOTE [A backward in two phases])
        self.chain = weight_chain(costs, whole, offloaded)
        self.back = False  # a whole pass: its last layer's reload has started
        self.started = False  # its backward has started


class _Stage:
    """The clocks of one rank while its actions run (NOTE [The stage model])."""

    def __init__(self, costs: list[LayerCosts], d2h: float, h2d: float) -> None:
        self.costs, self.d2h, self.h2d = costs, d2h, h2d
        self.compute = self.waited = self.exposed = 0.0
        self.streams: dict[int, float] = {}
        self.engines = {"d2h": 0.0, "h2d": 0.0}
        self.offloaded = 0

    def copy(self, chunk: int, direction: str, nbytes: int) -> float:
        """A copy on the chunk's stream issued now; returns when it is done."""
        rate = self.d2h if direction == "d2h" else self.h2d
        start = max(self.streams.get(chunk, 0.0), self.compute, self.engines[direction])
        done = start + nbytes / rate
        self.streams[chunk] = self.engines[direction] = done
        if direction == "d2h":
            self.offloaded += nbytes
        return done

    def wait_for(self, done: float) -> None:
        if done > self.compute:
            self.exposed += done - self.compute
            self.compute = done

    def offload(self, state: _Pass, chunk: int, layer: int) -> None:
        """Start the copy of ``layer`` to the host."""
        state.copy_done[layer] = self.copy(chunk, "d2h", self.costs[layer].offloaded_bytes)

    def release(self, state: _Pass, layer: int) -> None:
        """The compute stream waits for the layer's copy (its device memory goes)."""
        self.wait_for(state.copy_done.pop(layer))

    def reload(self, state: _Pass, chunk: int, layer: int) -> None:
        """Start the copy of ``layer`` back."""
        nbytes = self.costs[layer].offloaded_bytes
        state.reload_done[layer] = self.copy(chunk, "h2d", nbytes)


def weight_chain(costs: Sequence[LayerCosts], whole: bool, offloaded: Sequence[int]) -> list[int]:
    """The layers a pass's ``W`` (ZB-V) reloads, in the order torch's
    ``stage_backward_weight`` unpacks them: from the first up (NOTE [A backward in two
    phases] in engine/weight_pass.py)."""
    moved = range(len(costs)) if whole else offloaded
    return [j for j in moved if costs[j].offloaded_bytes > 0]


def split_bytes(
    retained: Sequence[int], during: Sequence[int], chain: Sequence[int], moved: Sequence[int]
) -> tuple[int, int, int]:
    """What a pass holds in ZB-V's split backward: the most during ``I`` (at layer ``j``
    what the backward holds there, ``during[j]``, beside what the retained graph keeps of
    the layers above, ``retained``), from ``I``'s end to ``W`` (``retained`` and ``W``'s
    first layer) and the most during ``W`` (two layers of its chain)."""
    above = [sum(retained[j + 1 :]) for j in range(len(retained))]
    input_peak = max(held + rest for held, rest in zip(during, above, strict=True))
    base = sum(retained)
    pairs = [moved[a] + moved[b] for a, b in zip(chain, chain[1:])]
    first = moved[chain[0]] if chain else 0
    return input_peak, base + first, base + max(pairs, default=first)


def stage_passes(
    costs: Sequence[LayerCosts], policy: StagePolicy, d2h: float, h2d: float
) -> tuple[Any, Any]:
    """What a pass of ``policy``'s kept passes and of its passes moved whole holds in each
    phase (:class:`~cpu_offload.plan.stage_plan.PassBytes`), for :func:`stage_peak`."""
    each = list(costs)
    layer_policy = first_k(len(each), policy.k)
    row = simulate_policy(layer_policy, each, d2h, h2d)
    whole = [c.saved_bytes for c in each]
    moved = [c.offloaded_bytes for c in each]
    stays = [c.saved_bytes - c.offloaded_bytes for c in each]
    offloaded = [j for j, c in enumerate(layer_policy) if c != "keep"]
    retained = [stays[j] if j in offloaded else whole[j] for j in range(len(each))]
    during = [held for step, _, held in row.log if step.startswith("bwd")][::-1]
    chain = weight_chain(each, False, offloaded)
    kept = kept_pass(row, *split_bytes(retained, during, chain, moved))
    at = [
        sum(stays[: max(j - 1, 0)]) + whole[j] + (whole[j - 1] if j >= 1 else 0)
        for j in range(len(each))
    ]
    split = split_bytes(stays, at, weight_chain(each, True, []), moved)
    return kept, moved_pass(whole, stays, split)


def simulate_stage(
    order: Sequence[Action],
    ready: Sequence[float],
    costs: LayerCosts | Sequence[LayerCosts],
    layers: int,
    policy: StagePolicy,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    accumulate_s: float = 0.0,
    weight_share: float = 0.5,
) -> StageRow:
    """Run one rank's ``order`` of actions (each waiting for its input's arrival,
    ``ready``) with ``policy`` on each of its stages of ``layers`` layers (NOTE [The stage
    model]); ``accumulate_s``: the stage's time to add a micro-batch's gradients;
    ``weight_share``: the part of a backward ZB-V's ``W`` runs.  Its peak is
    :func:`~cpu_offload.plan.stage_plan.stage_peak`'s."""
    each = costs.per_layer(layers) if isinstance(costs, LayerCosts) else list(costs)
    run = _Stage(each, d2h_bytes_per_s, h2d_bytes_per_s)
    layer_policy = first_k(layers, policy.k)
    passes: dict[tuple[int, int], _Pass] = {}
    whole_count = 0
    for action, arrival in zip(order, ready, strict=True):
        if arrival > run.compute:
            run.waited += arrival - run.compute
            run.compute = arrival
        key = (action.chunk, action.microbatch)
        if action.kind == FORWARD:
            waiting = _waiting(passes, action.chunk, key)
            whole = policy.keep_passes is not None and len(waiting) >= policy.keep_passes
            whole_count += whole
            passes[key] = _Pass(each, whole, layer_policy)
            _forward(run, passes[key], action)
        elif action.kind == WEIGHT:
            _weight(run, passes.pop(key), action, weight_share)
            run.compute += accumulate_s if action.microbatch > 0 else 0.0
        else:
            passes[key].started = True
            _backward_starts(run, passes, key, action.chunk, policy.keep_passes)
            share = 1.0 if action.kind == BACKWARD else 1 - weight_share
            _backward(run, passes[key], action, share)
            if action.kind == BACKWARD:
                run.compute += accumulate_s if action.microbatch > 0 else 0.0
                del passes[key]
            elif passes[key].chain:  # I ends: W's first layer comes back
                passes[key].reload_done = {}
                run.reload(passes[key], action.chunk, passes[key].chain[0])
    kept, moved = stage_passes(each, policy, d2h_bytes_per_s, h2d_bytes_per_s)
    return StageRow(
        peak_bytes=int(stage_peak(order, kept, moved, policy.keep_passes)),
        offloaded_bytes=run.offloaded,
        step_s=run.compute,
        exposed_copy_s=run.exposed,
        waited_s=run.waited,
        passes_moved_whole=whole_count,
    )


def _waiting(passes: dict[tuple[int, int], _Pass], chunk: int, key: tuple[int, int]) -> list[_Pass]:
    """The passes of the chunk's stage whose backward has not started, oldest first."""
    return [p for k, p in passes.items() if k[0] == chunk and k != key and not p.started]


def _forward(run: _Stage, state: _Pass, action: Action) -> None:
    """One pass's forward: a kept pass by the default schedule, a pass moved whole copying
    layer ``j - 1`` and releasing layer ``j - 2`` as layer ``j`` starts, and its last two
    layers as its forward ends (NOTE [Moving a pass whole] in engine/pass_schedule.py)."""
    each, L = run.costs, len(run.costs)
    released_at = {release: layer for layer, (release, _) in state.points.items()}
    for j in range(L):
        if state.whole:
            if j >= 1:
                run.offload(state, action.chunk, j - 1)
            if j >= 2:
                run.release(state, j - 2)
        else:
            if j >= 1 and (j - 1) in state.points:
                run.offload(state, action.chunk, j - 1)
            if j in released_at:
                run.release(state, released_at[j])
        run.compute += each[j].forward_s
        if state.whole and j == L - 1:
            run.offload(state, action.chunk, L - 1)
            for layer in range(max(L - 2, 0), L):
                run.release(state, layer)


def _backward_starts(
    run: _Stage,
    passes: dict[tuple[int, int], _Pass],
    key: tuple[int, int],
    chunk: int,
    keep: int | None,
) -> None:
    """The backward of ``key`` starts: a pass moved whole and not brought back starts its
    last layer's reload now (on demand), and so do the passes moved whole whose place in
    the queue drops below ``keep``; their other layers follow in their backward."""
    if keep is None:
        return
    for state in [passes[key], *_waiting(passes, chunk, key)[:keep]]:
        if state.whole and not state.back:
            state.back = True
            run.reload(state, chunk, len(run.costs) - 1)


def _backward(run: _Stage, state: _Pass, action: Action, share: float = 1.0) -> None:
    """One pass's backward (ZB-V's ``I``: ``share`` of it); a pass moved whole starts the
    reload of layer ``j - 1`` as its backward reaches layer ``j``."""
    each, L = run.costs, len(run.costs)
    reloaded_at = {reload: layer for layer, (_, reload) in state.points.items()}
    for j in reversed(range(L)):
        if state.whole and j >= 1:
            run.reload(state, action.chunk, j - 1)
        if j in reloaded_at:
            run.reload(state, action.chunk, reloaded_at[j])
        if j in state.reload_done:
            run.wait_for(state.reload_done[j])
        run.compute += each[j].backward_s * share


def _weight(run: _Stage, state: _Pass, action: Action, share: float) -> None:
    """ZB-V's ``W`` of one pass, from its first layer up: the first unpack of a layer of
    its chain starts the next one's reload, and waits for its own (NOTE [A backward in
    two phases] in engine/weight_pass.py)."""
    following = dict(zip(state.chain, state.chain[1:]))
    for j, costs in enumerate(run.costs):
        if j in state.chain:
            if j in following:
                run.reload(state, action.chunk, following[j])
            run.wait_for(state.reload_done[j])
        run.compute += costs.backward_s * share


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
