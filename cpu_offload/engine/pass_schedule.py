"""Offload by pass: which forward passes in flight move whole, and when they come back.

With ``keep_passes=N`` (``get_cpu_offload_context``, ``offload_layers``), of the forward
passes in flight in one context the ``N`` whose backwards come next run the per-layer
schedule (``schedule.py``); every other pass is *moved whole*.  Pipeline schedules
(1F1B, GPipe, interleaved) run a stage's backwards in the order of its forwards, so the
passes whose backwards come next are the oldest ones.

NOTE [Moving a pass whole]
    A pass is moved whole when, as its first layer's forward starts, ``N`` or more older
    passes wait for their backward (their backward has not started): its position in the
    backward queue is ``N`` or more.  All its layers are offloaded, the last included:
    at the forward of layer ``j`` the copy of layer ``j - 1`` starts and layer ``j - 2``
    is released (its copy had a layer's forward to run behind); at the end of the pass's
    forward the last layer's copy starts and the last two layers are released, so that
    the device holds nothing of the pass afterwards.  It comes back layer by layer, in
    the order its backward needs them, as the per-layer schedule reloads: when the
    backward of an older pass starts, the queue moves up, and each moved pass whose
    position is now below ``N`` starts the reload of its last layer only (prefetched
    behind the older pass's backward; a layer with nothing on the host is passed over,
    the one below it reloaded in its place); as its own backward reaches layer ``j``, the
    reload of layer ``j - 1`` starts (behind layer ``j``'s backward), and of any layer
    above it not started yet (a layer whose backward hook did not run).  The device so
    holds of a pass brought back one layer until its backward starts, and two layers
    while it runs, not the whole pass.  A backward that reaches a moved pass not brought
    back (the schedule ran a younger pass's backward first: reverse or interleaved
    orders) starts its last layer's reload then, without overlap (counted in
    ``stats.on_demand_reloads``, warned once), and the rest as above.  Every copy is the
    per-layer mechanism's (``layer_state.py``): what a pass moves whole computes what it
    computes kept.

NOTE [A backward queue per thread]
    The queue is per thread: a pass's position counts the waiting passes whose forward
    ran in the same thread (``ForwardPass.thread``), and a backward brings back only
    such passes.  Two threads that share a model run their steps in no order the
    schedule can know, so another thread's pass is never "next": moving it whole for a
    pass of this thread, or bringing it back from this thread's backward, would act on
    it while its own thread runs it.  Bringing it back from here raced with its own
    backward: its pop could find a layer whose reload this thread had started but not
    yet filled in (an ``IndexError`` in the pop; tests/offload/test_pass_threads.py forces
    that interleaving).  A thread's passes still move whole behind its own, and each
    pass's layers are copied and reloaded from the thread that runs it.  The thread is
    the forward's: a backward that autograd runs in a worker thread (a device's) brings
    back the passes of the thread that ran the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..device.amounts import integer
from ..log import warn
from ..report.stats import OffloadStats
from .forward_pass import ForwardPass
from .transitions import LayerState

__all__ = ["PassSchedule", "check_keep_passes", "counts_from_now", "moves_whole"]


def check_keep_passes(keep_passes: object, owner: str = "cpu_offload") -> int | None:
    """``keep_passes`` after checking it is None or an int >= 1 (TypeError, ValueError)."""
    if keep_passes is None:
        return None
    if (whole := integer(keep_passes)) is None:
        raise TypeError(
            f"{owner}: keep_passes must be an int >= 1 (the forward passes in flight that "
            f"keep the per-layer schedule) or None, got {type(keep_passes).__name__} "
            f"{keep_passes!r}."
        )
    if whole < 1:
        raise ValueError(
            f"{owner}: keep_passes must be an int >= 1 (the forward passes in flight that "
            f"keep the per-layer schedule; the pass whose backward is next always does), "
            f"got {keep_passes!r}. Pass None to offload every pass by the per-layer schedule."
        )
    return whole


def moves_whole(position: int, keep_passes: int | None) -> bool:
    """Whether a pass at ``position`` in the backward queue (0: its backward is next) moves
    whole under ``keep_passes`` (None: no pass does)."""
    return keep_passes is not None and position >= keep_passes


class PassSchedule:
    """The schedule of passes moved whole (NOTE [Moving a pass whole]).

    Args:
        keep_passes: ``N``, the passes in flight that keep the per-layer schedule.
        stats: the context's counters (``passes_moved_whole``, ``on_demand_reloads``).
    """

    def __init__(self, keep_passes: int, stats: OffloadStats) -> None:
        self.keep_passes = keep_passes
        self.stats = stats
        self._warned = False

    def pass_starts(self, forward_pass: ForwardPass, waiting: Sequence[ForwardPass]) -> None:
        """``forward_pass`` starts its forward behind ``waiting`` (older passes whose
        backward has not started): it moves whole if its position (among the passes of
        its thread: NOTE [A backward queue per thread]) is ``N`` or more."""
        ahead = len(same_thread(forward_pass, waiting))
        forward_pass.moved_whole = moves_whole(ahead, self.keep_passes)
        if forward_pass.moved_whole:
            self.stats.passes_moved_whole += 1

    @staticmethod
    def on_forward(forward_pass: ForwardPass, layer: int) -> None:
        """The forward of ``layer`` of a moved pass starts."""
        if layer >= 1:
            forward_pass.state(layer - 1).start_offload()
        if layer >= 2:
            forward_pass.state(layer - 2).release_activation_forward_gpu_memory()

    @staticmethod
    def on_forward_end(forward_pass: ForwardPass) -> None:
        """The forward of a moved pass ended: its last layer goes too."""
        last = forward_pass.model_layers - 1
        forward_pass.state(last).start_offload()
        for layer in range(max(last - 1, 0), last + 1):
            forward_pass.state(layer).release_activation_forward_gpu_memory()

    def backward_starts(self, forward_pass: ForwardPass, waiting: Sequence[ForwardPass]) -> None:
        """The backward of ``forward_pass`` starts; ``waiting``: the passes whose
        backward has not started, oldest first.  A moved pass not brought back starts
        its last layer's reload now (on demand); the moved passes of its thread that
        move up to a position below ``N`` start bringing their last layer back."""
        if forward_pass.moved_whole and not forward_pass.brought_back:
            self._reload_on_demand(forward_pass)
        for queued in same_thread(forward_pass, waiting)[: self.keep_passes]:
            if queued.moved_whole and not queued.brought_back:
                self.bring_back(queued)

    @staticmethod
    def bring_back(forward_pass: ForwardPass) -> None:
        """Start the reload of a moved pass's last layer (the first its backward needs);
        the others follow as its backward runs (:meth:`on_backward`)."""
        forward_pass.brought_back = True
        forward_pass.reload_next = forward_pass.layers_forwarded - 1
        PassSchedule.reload_down_to(forward_pass, forward_pass.reload_next)

    @staticmethod
    def on_backward(forward_pass: ForwardPass, layer: int) -> None:
        """Backward reaches ``layer`` of a moved pass: the reload of the layer below it
        starts (and of any layer above it not started yet)."""
        PassSchedule.reload_down_to(forward_pass, layer - 1)

    @staticmethod
    def reload_down_to(forward_pass: ForwardPass, lowest: int) -> None:
        """Start the reloads of the pass's layers from its next one down to ``lowest``;
        a layer with nothing on the host is passed over, the one below it reloaded in
        its place."""
        while forward_pass.reload_next >= max(lowest, 0):
            layer = forward_pass.reload_next
            state = forward_pass.made_state(layer)
            forward_pass.reload_next -= 1
            if state is not None and state.state is LayerState.OFFLOAD_FINISHED:
                state.start_reload()
            if layer == lowest and (state is None or not state.num_offloaded_tensors):
                lowest -= 1

    def _reload_on_demand(self, forward_pass: ForwardPass) -> None:
        top = None  # the highest layer on the host: the one its backward needs first
        for layer in reversed(range(forward_pass.layers_forwarded)):
            state = forward_pass.made_state(layer)
            if state is None:
                continue
            if state.state is LayerState.OFFLOAD_STARTED:
                state.release_activation_forward_gpu_memory()  # its forward just ended
            if top is None and state.state is LayerState.OFFLOAD_FINISHED:
                top = state
        if top is not None and top.holds_data():
            self.stats.on_demand_reloads += 1  # the layer its backward needs first
        if not self._warned and forward_pass.layers_forwarded:
            self._warned = True
            warn(
                f"cpu_offload: the backward of forward pass {forward_pass.index} started "
                f"before the backward of an older pass in flight; with keep_passes="
                f"{self.keep_passes} it had been moved whole to the host, and its last "
                "layer is reloaded now, without overlap with compute. keep_passes expects "
                "each pass's backward in the order of the forwards (1F1B, GPipe); raise "
                "keep_passes to the passes in flight, or pass None, for other orders. This "
                "warning is shown once.",
                UserWarning,
                stacklevel=6,
            )
        self.bring_back(forward_pass)


def counts_from_now(
    forward_pass: ForwardPass,
    stats: OffloadStats,
    lock: AbstractContextManager[Any],
    schedule: PassSchedule | None,
    waiting: Callable[[], Sequence[ForwardPass]],
) -> None:
    """A layer of ``forward_pass`` starts with grad enabled, its first: the pass counts
    (``stats.forward_passes``, under ``lock``) and takes its place in its thread's
    backward queue (``waiting()``, which leaves it out) from now on (NOTE [A pass that
    saves nothing] in forward_pass.py)."""
    forward_pass.with_grad = True
    with lock:
        stats.forward_passes += 1
    if schedule is not None:
        schedule.pass_starts(forward_pass, waiting())


def same_thread(forward_pass: ForwardPass, passes: Sequence[ForwardPass]) -> list[ForwardPass]:
    """Those of ``passes`` whose forward ran in the thread of ``forward_pass``'s, itself
    left out (NOTE [A backward queue per thread])."""
    thread = forward_pass.thread
    return [p for p in passes if p.thread == thread and p is not forward_pass]


def held_on_device(
    passes: Sequence[ForwardPass],
    saved: Sequence[int],
    stays: Sequence[int],
    recompute: Sequence[int] | None = None,
) -> int:
    """The bytes of saved activations ``passes`` hold on the device now, by the
    offloader's counts: per layer ``saved[j]`` (what the layer saves in a step: a
    checkpointed layer's inputs) while its state has it on the device (not offloaded,
    being copied, or reloaded), ``stays[j]`` (what cannot move) while its data is on the
    host, nothing once its backward ran or before its forward; and while the backward of
    layer ``j`` runs, ``recompute[j]`` more (a checkpointed layer's recompute: what it
    saves beside its inputs; none where None)."""
    on_host = (LayerState.OFFLOAD_FINISHED,)
    total = 0
    for forward_pass in passes:
        backward_at = forward_pass.previous_bwd_layer
        done = forward_pass.backward_reached and backward_at is None  # backward over
        for layer in range(forward_pass.layers_forwarded):
            if done or (backward_at is not None and layer > backward_at):
                continue
            if layer == backward_at and recompute is not None:
                total += recompute[layer]
            state = forward_pass.made_state(layer)
            total += stays[layer] if state is not None and state.state in on_host else saved[layer]
    return total
