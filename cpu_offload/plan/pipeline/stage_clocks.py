"""The clocks of one rank as it runs its order with offload (NOTE [The stage model] in
``stage_model.py``): its compute stream, a copy stream per stage of the rank, one
device-to-host and one host-to-device engine, and each pass's copies in flight."""

from __future__ import annotations

from collections.abc import Sequence

from ...engine.schedule import schedule_points
from ...policy.policy import OFFLOADED
from ..schedule_model import LayerCosts
from .orders import BACKWARD, FORWARD, WEIGHT, Action

__all__ = ["PassClock", "StageClock", "run_order", "weight_chain"]


class PassClock:
    """One pass's copies in flight."""

    def __init__(self, costs: list[LayerCosts], whole: bool, policy: list[str]) -> None:
        self.whole = whole
        self.copy_done: dict[int, float] = {}
        self.reload_done: dict[int, float] = {}
        offloaded = [j for j, c in enumerate(policy) if c in OFFLOADED]
        self.points = {} if whole else schedule_points(len(costs), offloaded)
        #: the layers ZB-V's W reloads, in its order (NOTE [A backward in two phases])
        self.chain = weight_chain(costs, whole, offloaded)
        self.back = False  # a whole pass: its last layer's reload has started
        self.started = False  # its backward has started


class StageClock:
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

    def offload(self, state: PassClock, chunk: int, layer: int) -> None:
        """Start the copy of ``layer`` to the host."""
        state.copy_done[layer] = self.copy(chunk, "d2h", self.costs[layer].offloaded_bytes)

    def release(self, state: PassClock, layer: int) -> None:
        """The compute stream waits for the layer's copy (its device memory goes)."""
        self.wait_for(state.copy_done.pop(layer))

    def reload(self, state: PassClock, chunk: int, layer: int) -> None:
        """Start the copy of ``layer`` back."""
        nbytes = self.costs[layer].offloaded_bytes
        state.reload_done[layer] = self.copy(chunk, "h2d", nbytes)


def weight_chain(costs: Sequence[LayerCosts], whole: bool, offloaded: Sequence[int]) -> list[int]:
    """The layers a pass's ``W`` (ZB-V) reloads, in the order torch's
    ``stage_backward_weight`` unpacks them: from the first up (NOTE [A backward in two
    phases] in engine/weight_pass.py)."""
    moved = range(len(costs)) if whole else offloaded
    return [j for j in moved if costs[j].offloaded_bytes > 0]


def waiting_passes(
    passes: dict[tuple[int, int], PassClock], chunk: int, key: tuple[int, int]
) -> list[PassClock]:
    """The passes of the chunk's stage whose backward has not started, oldest first."""
    return [p for k, p in passes.items() if k[0] == chunk and k != key and not p.started]


def run_forward(run: StageClock, state: PassClock, action: Action) -> None:
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


def backward_starts(
    run: StageClock,
    passes: dict[tuple[int, int], PassClock],
    key: tuple[int, int],
    chunk: int,
    keep: int | None,
) -> None:
    """The backward of ``key`` starts: a pass moved whole and not brought back starts its
    last layer's reload now (on demand), and so do the passes moved whole whose place in
    the queue drops below ``keep``; their other layers follow in their backward."""
    if keep is None:
        return
    for state in [passes[key], *waiting_passes(passes, chunk, key)[:keep]]:
        if state.whole and not state.back:
            state.back = True
            run.reload(state, chunk, len(run.costs) - 1)


def run_backward(run: StageClock, state: PassClock, action: Action, share: float = 1.0) -> None:
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


def run_weight(run: StageClock, state: PassClock, action: Action, share: float) -> None:
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


def run_order(
    order: Sequence[Action],
    ready: Sequence[float],
    each: list[LayerCosts],
    layer_policy: list[str],
    keep_passes: int | None,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    accumulate_s: float = 0.0,
    weight_share: float = 0.5,
) -> tuple[StageClock, int]:
    """Run one rank's ``order`` (each action waiting for its input's arrival, ``ready``),
    every pass keeping ``layer_policy`` or, beyond the ``keep_passes`` oldest waiting,
    moved whole; returns the clocks at the end and the passes moved whole."""
    run = StageClock(each, d2h_bytes_per_s, h2d_bytes_per_s)
    passes: dict[tuple[int, int], PassClock] = {}
    whole_count = 0
    for action, arrival in zip(order, ready, strict=True):
        if arrival > run.compute:
            run.waited += arrival - run.compute
            run.compute = arrival
        key = (action.chunk, action.microbatch)
        if action.kind == FORWARD:
            waiting = waiting_passes(passes, action.chunk, key)
            whole = keep_passes is not None and len(waiting) >= keep_passes
            whole_count += whole
            passes[key] = PassClock(each, whole, layer_policy)
            run_forward(run, passes[key], action)
        elif action.kind == WEIGHT:
            run_weight(run, passes.pop(key), action, weight_share)
            run.compute += accumulate_s if action.microbatch > 0 else 0.0
        else:
            passes[key].started = True
            backward_starts(run, passes, key, action.chunk, keep_passes)
            share = 1.0 if action.kind == BACKWARD else 1 - weight_share
            run_backward(run, passes[key], action, share)
            if action.kind == BACKWARD:
                run.compute += accumulate_s if action.microbatch > 0 else 0.0
                del passes[key]
            elif passes[key].chain:  # I ends: W's first layer comes back
                passes[key].reload_done = {}
                run.reload(passes[key], action.chunk, passes[key].chain[0])
    return run, whole_count
