"""The stage model: one pure function (:func:`simulate_stage`) from a rank's order of
actions, its stage's per-layer bytes and costs and a policy to the stage's peak and
step time; the planner per stage (``search.py``) and a memory budget inside a stage
(``plan/stage_plan.py``) both use its peak (:func:`stage_peak`) and the bytes a pass
holds (:class:`PassBytes`).

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
      (``j - 1`` being reloaded) beside ``stays`` below, a checkpointed layer ``j``
      every byte its recompute saves (``running``: the whole layer, as in a kept
      pass's backward, not only its inputs).
    - ZB-V's split backward (NOTE [A backward in two phases] in engine/weight_pass.py):
      ``I`` runs as a backward of the pass's policy, but the retained graph keeps what
      stays of the layers it passed; from its end to ``W`` the pass holds what stays
      and the first layer ``W`` reloads; in ``W``, two layers of what it moved at most
      (one reloaded, the next reloading) beside what stays.

    The planner per stage walks each rank's own order; inside a stage, where only the
    passes in flight are measured, the walk is of the order that holds them longest (all
    ``n`` forwards, then the backwards: GPipe's), with a per-layer policy's single-pass


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

    The stage's peak is the model of NOTE [A stage's passes in flight]
    (:func:`stage_peak`), walked over the rank's order: memory moves only at layer
    boundaries, so the clocks above (``stage_clocks.py``) do not change it.


Every figure is a prediction; memory is the layers' saved activations only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...policy.policy import CHECKPOINTED, OFFLOADED
from ...report.policy_words import describe_policy, pass_policy_words
from ..schedule_model import LayerCosts, PlanRow, first_k, simulate_policy
from .orders import FORWARD, INPUT, WEIGHT, Action
from .stage_clocks import run_order, weight_chain

__all__ = [
    "PassBytes",
    "StagePolicy",
    "StageRow",
    "kept_pass",
    "moved_pass",
    "pass_costs",
    "simulate_stage",
    "split_bytes",
    "stage_memory",
    "stage_passes",
    "stage_peak",
]


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
    holds in ZB-V's split backward (:func:`split_bytes`)."""
    forward = max((held for step, _, held in row.log if step.startswith("fwd")), default=0)
    backward = max((held for step, _, held in row.log if step.startswith("bwd")), default=0)
    eof = row.end_of_forward_bytes
    return PassBytes(forward, eof, eof, backward, split, input, weight)


def moved_pass(
    whole: Any, stays: Any, split: tuple[Any, Any, Any] | None = None, running: Any = None
) -> PassBytes:
    """A pass moved whole, from each layer's ``whole`` and ``stays`` bytes (one row per
    layer's bytes, or one row per candidate policy and a column per layer); ``split``:
    what it holds in ZB-V's split backward (``input``, ``split``, ``weight``);
    ``running``: what each layer holds while its own backward runs (a checkpointed
    layer's recompute saves the whole layer again; ``whole`` where None)."""
    whole, stays = np.atleast_2d(whole), np.atleast_2d(stays)
    running = whole if running is None else np.atleast_2d(running)
    layers = whole.shape[1]
    below = np.concatenate([np.zeros_like(stays[:, :1]), np.cumsum(stays, axis=1)], axis=1)

    def at(j: int, own: np.ndarray) -> Any:  # layer j (forward or backward), j - 1 whole
        return below[:, max(j - 1, 0)] + (whole[:, j - 1] if j >= 1 else 0) + own[:, j]

    forward = np.max(np.stack([below[:, layers], *(at(j, whole) for j in range(layers - 1))]), 0)
    backward = np.max(np.stack([at(j, running) for j in range(layers)]), axis=0)
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


def stage_memory(
    order: Sequence[Action], kept: PassBytes, moved: PassBytes, keep_passes: int | None
) -> list[Any]:
    """The stage's memory over time: the most its passes hold on the device at once
    during each action of ``order``, each pass keeping the per-layer policy (``kept``)
    or, beyond the ``keep_passes`` whose backwards come next, moved whole (``moved``);
    NOTE [A stage's passes in flight]."""
    passes: dict[tuple[int, int], _Held] = {}
    held: list[Any] = []

    def queue(chunk: int) -> list[_Held]:
        return [p for k, p in passes.items() if k[0] == chunk and not p.started]

    for action in order:
        key = (action.chunk, action.microbatch)
        if action.kind == FORWARD:
            whole = keep_passes is not None and len(queue(action.chunk)) >= keep_passes
            own = moved if whole else kept
            held.append(sum(p.held for p in passes.values()) + own.forward)
            passes[key] = _Held(whole, own.waiting)
        elif action.kind == WEIGHT:
            state = passes.pop(key)
            own = moved if state.whole else kept
            held.append(sum(p.held for p in passes.values()) + own.weight)
        else:
            state = passes[key]
            state.started, state.held = True, 0
            for other in queue(action.chunk)[: keep_passes or 0]:
                if other.whole and not other.back:
                    other.back, other.held = True, moved.back
            own = moved if state.whole else kept
            during = own.input if action.kind == INPUT else own.backward
            held.append(sum(p.held for p in passes.values()) + during)
            if action.kind == INPUT:
                state.held = own.split
            else:
                del passes[key]
    return held


def stage_peak(
    order: Sequence[Action], kept: PassBytes, moved: PassBytes, keep_passes: int | None
) -> Any:
    """The most a stage's passes hold on the device at once as it runs ``order``: the
    largest of :func:`stage_memory` (per candidate policy, where the bytes are arrays)."""
    return functools.reduce(np.maximum, stage_memory(order, kept, moved, keep_passes), 0)


@dataclass(frozen=True)
class StagePolicy:
    """What a stage does: ``k`` layers of each kept pass offloaded per layer (the
    default schedule's first ``k``, or ``layers``' choices where given), and with
    ``keep_passes`` set, every pass but the ``keep_passes`` oldest in flight moved whole.

    Attributes:
        layers: the per-layer policy of a kept pass (``keep``, ``offload``,
            ``checkpoint``, ``checkpoint+offload`` per layer), as a memory budget inside
            a stage chooses it; None: the first ``k`` offloaded.  A checkpointed layer is
            checkpointed in every pass, moved whole or not (:func:`pass_costs`).
    """

    k: int
    keep_passes: int | None = None
    layers: tuple[str, ...] | None = None

    def per_layer(self, layers: int) -> list[str]:
        """A kept pass's policy, one choice per layer."""
        return list(self.layers) if self.layers is not None else first_k(layers, self.k)

    def words(self, layers: int, in_flight: int | None = None) -> str:
        """The policy in words, as the step report and the handle say it: ``"layers 0-1
        offload, 2-3 keep; keep 1 pass, 3 of 4 moved whole"``."""
        text = f"layers {describe_policy(self.per_layer(layers))}"
        if self.keep_passes is not None:
            text += f"; {pass_policy_words(self.keep_passes, in_flight)}"
        return text


def pass_costs(costs: Sequence[LayerCosts], layer_policy: Sequence[str]) -> list[LayerCosts]:
    """Each layer's costs as a pass of ``layer_policy`` runs it, for the stage's clocks and
    its passes moved whole: a checkpointed layer saves its inputs (and can move what of
    them ``input_offloaded_bytes`` says) and its backward runs its forward again first
    (``recompute``); the other layers as they are."""
    return [
        dataclasses.replace(
            c,
            saved_bytes=c.input_bytes,
            offloaded_bytes=c.input_offloaded_bytes,
            kept_bytes=c.input_bytes - c.input_offloaded_bytes,
            backward_s=c.backward_s + c.recompute,
            following=None,
            unpacks=(),
        )
        if choice in CHECKPOINTED
        else c
        for c, choice in zip(costs, layer_policy, strict=True)
    ]


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
        held_bytes: the stage's memory over time: the most on the device during each
            action of its order (:func:`stage_memory`); ``peak_bytes`` is the largest.
    """

    peak_bytes: int
    offloaded_bytes: int
    step_s: float
    exposed_copy_s: float
    waited_s: float
    passes_moved_whole: int
    held_bytes: tuple[int, ...] = field(default=(), repr=False)


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
    phase (:class:`PassBytes`), for :func:`stage_peak`."""
    layer_policy = policy.per_layer(len(costs))
    row = simulate_policy(layer_policy, list(costs), d2h, h2d)
    each = pass_costs(costs, layer_policy)
    whole = [c.saved_bytes for c in each]
    moved = [c.offloaded_bytes for c in each]
    stays = [c.saved_bytes - c.offloaded_bytes for c in each]
    offloaded = [j for j, c in enumerate(layer_policy) if c in OFFLOADED]
    retained = [stays[j] if j in offloaded else whole[j] for j in range(len(each))]
    during = [held for step, _, held in row.log if step.startswith("bwd")][::-1]
    chain = weight_chain(each, False, offloaded)
    kept = kept_pass(row, *split_bytes(retained, during, chain, moved))
    # a checkpointed layer's backward holds its recompute: the whole layer (kept_pass's too)
    running = [c.saved_bytes for c in costs]
    at = [
        sum(stays[: max(j - 1, 0)]) + running[j] + (whole[j - 1] if j >= 1 else 0)
        for j in range(len(each))
    ]
    split = split_bytes(stays, at, weight_chain(each, True, []), moved)
    return kept, moved_pass(whole, stays, split, running)


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
    :func:`stage_peak`'s."""
    each = costs.per_layer(layers) if isinstance(costs, LayerCosts) else list(costs)
    layer_policy = policy.per_layer(layers)
    run, whole_count = run_order(
        order,
        ready,
        pass_costs(each, layer_policy),
        layer_policy,
        policy.keep_passes,
        d2h_bytes_per_s,
        h2d_bytes_per_s,
        accumulate_s,
        weight_share,
    )
    kept, moved = stage_passes(each, policy, d2h_bytes_per_s, h2d_bytes_per_s)
    held = tuple(int(x) for x in stage_memory(order, kept, moved, policy.keep_passes))
    return StageRow(
        peak_bytes=max(held, default=0),
        offloaded_bytes=run.offloaded,
        step_s=run.compute,
        exposed_copy_s=run.exposed,
        waited_s=run.waited,
        passes_moved_whole=whole_count,
        held_bytes=held,
    )
