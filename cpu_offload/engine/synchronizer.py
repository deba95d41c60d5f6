"""Synchronizers: the schedule that decides when each layer offloads and reloads.

A synchronizer counts layers as their forwards start (``fwd_step``) and as
backward reaches them (``bwd_step``), and drives the layer states of the forward
pass they belong to.  It holds finished forward passes only weakly: a pass lives
as long as its autograd graph.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CpuOffloadError
from ..hooks.handles import unpack_saved
from ..hooks.marks import set_mark
from ..hooks.per_thread import PerThread
from ..hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL
from ..log import warn
from .forward_pass import ForwardPass
from .layer_state import OffloadableLayerState
from .offload_engine import OffloadEngine
from .pass_schedule import PassSchedule, check_keep_passes, counts_from_now
from .schedule import check_offloaded_layers, max_offloaded, schedule_points
from .transitions import LayerState

__all__ = ["DefaultOffloadSynchronizer", "OffloadSynchronizer", "PassRef"]

PassRef = ForwardPass | int | None


def _check_model_layers(num_layers: object) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"cpu_offload: model_layers must be an int >= 1, got {num_layers!r}.")


class _ForwardInProgress:
    """The forward pass a thread is running (see NOTE [Who owns a forward pass])."""

    __slots__ = ("current", "finished", "backward")

    def __init__(self) -> None:
        self.current: ForwardPass | None = None
        self.finished: weakref.ref[ForwardPass] | None = None  # the last pass whose forward ended
        self.backward: weakref.ref[ForwardPass] | None = None  # the pass backward reached last


def _pass_in_flight(passes: list[ForwardPass], index: int | None) -> ForwardPass:
    """The pass of ``passes`` numbered ``index`` (None: the latest), or the error that
    says there is none."""
    if index is None and passes:
        return passes[-1]
    for candidate in passes if index is not None else []:
        if candidate.index == index:
            return candidate
    raise CpuOffloadError(
        f"cpu_offload: no forward pass {'in flight' if index is None else index}"
        f" (in flight: {[p.index for p in passes]}). A pass lives while its autograd "
        "graph does: call the sync function on each layer's output, and address a "
        "pass before its backward has finished."
    )


class OffloadSynchronizer(OffloadEngine):
    """Tracks forward passes and layers; offloads nothing by itself.

    NOTE [Who owns a forward pass]
        The graph owns a pass, never the reverse: the backward pre-hooks that
        ``sync_fn`` registers hold the pass, the handles that autograd saved hold its
        layers, and the layers hold plain memory (NOTE [Saved tensors without their
        history] in layer_state.py).  A graph dropped without a backward frees its
        handles, and with them the layers' host buffers and device tensors, at once.
        The synchronizer holds finished passes weakly, and the pass a thread is
        forwarding strongly (its layers are counted even across a graph cut); an
        exception inside a layer ends that pass, and a pass left between two layers
        (its last output and its graph gone) is replaced at the next forward and is
        no longer reported as in flight.  Each thread forwards its own pass: two
        threads may run forward and backward through one model, as they may
        without offload.

    Args:
        num_layers: layers per forward pass (``model_layers``; TransformerEngine's name).
        retain_pinned_cpu_buffers: keep host buffers for the next iteration.
        offload_stream: stream for all copies; a new one by default.
        device: device whose tensors are offloaded; the best available by default.
        min_offload_numel: smaller saved tensors stay on the device.
        min_offload_bytes: so do saved tensors of fewer bytes.
        max_host_bytes: the most host memory the buffer pool may hold; a tensor that
            does not fit stays on the device (``stats.tensors_kept_by_host_cap``).
    """

    def __init__(
        self,
        num_layers: int,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: Any = None,
        *,
        device: torch.device | str | None = None,
        min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL,
        min_offload_bytes: int = 0,
        max_host_bytes: int | str | None = None,
    ) -> None:
        _check_model_layers(num_layers)
        super().__init__(
            retain_pinned_cpu_buffers,
            offload_stream,
            device=device,
            min_offload_numel=min_offload_numel,
            min_offload_bytes=min_offload_bytes,
            max_host_bytes=max_host_bytes,
        )
        self.model_layers = num_layers
        #: warn (once) when a whole forward pass moved nothing because of the threshold
        self.warn_if_nothing_moved = True
        self._forwarding = PerThread(_ForwardInProgress)
        self._driven_by_hand: ForwardPass | None = None  # see bwd_step
        self._passes: list[weakref.ref[ForwardPass]] = []  # in flight, oldest first
        self._numbers = itertools.count()
        self._passes_lock = threading.Lock()
        self.keep_passes: int | None = None  # NOTE [Moving a pass whole] in pass_schedule.py
        self.pass_schedule: PassSchedule | None = None

    @property
    def num_layers(self) -> int:
        """The layers per forward pass, :attr:`model_layers` (TransformerEngine's name)."""
        return self.model_layers

    # ------------------------------------------------------------ passes

    def _new_pass(self) -> ForwardPass:
        # numbered per synchronizer: a handle's first step is its forward pass 0
        forward_pass = ForwardPass(self.model_layers, self.new_layer_state, next(self._numbers))
        with self._passes_lock:
            self._passes = [ref for ref in self._passes if ref() is not None]
            self._passes.append(weakref.ref(forward_pass))
        return forward_pass

    def waiting_passes(self) -> list[ForwardPass]:
        """Passes in flight whose backward has not started, oldest first (a stage's queue)."""
        return [p for p in self.in_flight_passes() if p.with_grad and not p.backward_reached]

    def in_flight_passes(self) -> list[ForwardPass]:
        """Forward passes whose graphs are alive, oldest first (not a pass left between
        two layers whose last output and graph are gone)."""
        alive = [ref() for ref in self._passes]
        return [p for p in alive if p is not None and not p.abandoned()]

    def resolve_pass(self, forward_pass: PassRef = None) -> ForwardPass:
        """A pass given as object or index; ``None`` means the latest one."""
        if isinstance(forward_pass, ForwardPass):
            return forward_pass
        return _pass_in_flight(self.in_flight_passes(), forward_pass)

    @property
    def layer_states(self) -> list[OffloadableLayerState]:
        """Layer states of the latest forward pass."""
        return self.resolve_pass().layer_states

    @property
    def current_pass(self) -> ForwardPass | None:
        """The pass whose forward is in progress in this thread, if any."""
        return self._forwarding.value.current

    def _set_current(self, forward_pass: ForwardPass | None) -> None:
        self._forwarding.value.current = forward_pass

    def layer_is_offloaded(self, layer: int) -> bool:
        """Whether this synchronizer may offload ``layer`` (hooks are installed for it)."""
        return True

    # --------------------------------------------------------- forward

    def fwd_step(self) -> int:
        """Called as a layer's forward starts; returns that layer's index.

        A new pass starts after ``model_layers`` layers, and also when the pass in
        progress was abandoned (see :meth:`ForwardPass.abandoned`: an exception
        between two layers, say)."""
        return self.forward_step()[0]

    def forward_step(self) -> tuple[int, ForwardPass]:
        """:meth:`fwd_step`, returning the layer's pass as well."""
        forwarding = self._forwarding.value
        forward_pass = forwarding.current
        if (
            forward_pass is None
            or forward_pass.forward_done
            or forward_pass.backward_reached
            or forward_pass.abandoned()
        ):
            forward_pass = self._new_pass()
            forward_pass.follows, forwarding.finished = forwarding.finished, None
            forwarding.current = forward_pass
        if not forward_pass.with_grad and torch.is_grad_enabled():
            lock, schedule = self._passes_lock, self.pass_schedule
            counts_from_now(forward_pass, self.stats, lock, schedule, self.waiting_passes)
        layer = forward_pass.layers_forwarded
        forward_pass.layers_forwarded += 1
        self._on_forward(forward_pass, layer)
        return layer, forward_pass

    def fwd_end(self) -> None:
        """Called as a layer's forward ends; the last layer hands the pass to its graph."""
        forwarding = self._forwarding.value
        current = forwarding.current
        if current is not None and current.forward_done:
            forwarding.current = None
            forwarding.finished = current.weak
            current.end_of_forward = self.measure_end_of_forward()
            self._on_forward_end(current)

    def skip_layer(self) -> None:
        """A layer that did not run in this pass (LayerDrop) counts as an empty one."""
        self.fwd_step()
        self.fwd_end()

    def abort_forward(self, failed: bool = True) -> None:
        """End the pass in progress early: the next layer's forward starts a new pass.
        ``failed``: an exception escaped a layer (else an earlier layer runs again). The
        pass keeps what its partial graph saved: a backward through it works, and the
        memory goes with the graph."""
        self._set_current(None)

    def push_tensor(self, tensor: Any, offload_base_tensor: bool = False) -> Any:
        """Hand a tensor to the layer whose forward is in progress, by hand.

        The layer holds it until the layer is released after its backward, whether or
        not the handle is kept (TransformerEngine's contract); ``offload_base_tensor``
        moves a view through its base, as :func:`cpu_offload.start_offload` does."""
        if offload_base_tensor and isinstance(tensor, torch.Tensor) and tensor._base is not None:
            set_mark(tensor, offload_base=True)
        current = self.current_pass
        if current is None:
            raise CpuOffloadError("cpu_offload: push_tensor called outside a layer's forward.")
        return current.state(current.layers_forwarded - 1).push_by_hand(tensor)

    def pop_tensor(self, handle: Any) -> Any:
        """Give back a saved tensor (the handle knows its layer)."""
        return unpack_saved(handle)

    def _on_forward(self, forward_pass: ForwardPass, layer: int) -> None:
        """Schedule hook: the forward of ``layer`` starts."""

    def _on_forward_end(self, forward_pass: ForwardPass) -> None:
        """Schedule hook: the forward of the pass's last layer ended."""

    # -------------------------------------------------------- backward

    def bwd_step(self, layer: int, forward_pass: PassRef = None) -> None:
        """Called as backward reaches ``layer`` (before its backward runs)."""
        forward_pass = self.resolve_pass(forward_pass)
        if not forward_pass.backward_reached:
            # A forward that ended early ends here: the next fwd_step starts a new pass.
            forward_pass.backward_reached = True
            if self.pass_schedule is not None:
                self.pass_schedule.backward_starts(forward_pass, self.waiting_passes())
            if forward_pass._token is None and forward_pass is self.current_pass:
                # Driven by hand (no context, no graph holds the pass): keep it until
                # finish_part_of_bwd, as TransformerEngine's synchronizer keeps its states.
                self._driven_by_hand = forward_pass
        previous = forward_pass.previous_bwd_layer
        if previous is not None and previous != layer:
            self._release(forward_pass, previous)
        forward_pass.previous_bwd_layer = layer
        self._forwarding.value.backward = forward_pass.weak
        self._on_backward(forward_pass, layer)

    def note_recompute(self, *layers: int) -> None:
        """A checkpoint recomputed ``layers``: for the pass backward reached last here."""
        ref = self._forwarding.value.backward
        forward_pass = ref() if ref is not None else None
        index = forward_pass.index if forward_pass is not None else None
        self.recorder.note_recompute(index, *layers)

    def finish_part_of_bwd(self, forward_pass: PassRef = None) -> None:
        """Called once at the end of each backward call: release the last layer."""
        forward_pass = self.resolve_pass(forward_pass)
        forward_pass.finish_queued = False
        previous = forward_pass.previous_bwd_layer
        if previous is not None:
            self._release(forward_pass, previous)
        forward_pass.previous_bwd_layer = None
        if self._driven_by_hand is forward_pass:
            self._driven_by_hand = None
        self.end_step(forward_pass.step_record())

    def _on_backward(self, forward_pass: ForwardPass, layer: int) -> None:
        """Schedule hook: backward reaches ``layer``."""

    @staticmethod
    def _release(forward_pass: ForwardPass, layer: int) -> None:
        """Backward is past ``layer``: drop its device tensors (a layer with no state
        has none)."""
        state = forward_pass.made_state(layer)
        if state is not None:
            state.release_all_memory()

    # ------------------------------------------------------------ queries

    def get_offloaded_total_size_mb(self) -> float:
        """MiB of offloaded data in host memory now, over all passes in flight."""
        return sum(p.get_offloaded_total_size_mb() for p in self.in_flight_passes())


class DefaultOffloadSynchronizer(OffloadSynchronizer):
    """Offloads layers ``0..k-1`` of every pass on a fixed schedule.

    At the forward of layer ``j`` the offload of layer ``j - 1`` starts and layer
    ``i`` is released when ``j == L - k + i``; at the backward of layer ``j`` the
    reload of layer ``i`` starts when ``j == L - 1 - k + i``.  The device then holds
    at most ``L - k`` layers' activations at the end of the forward pass.

    Constructed as TransformerEngine's, ``DefaultOffloadSynchronizer(num_layers=L,
    num_offloaded_layers=k)``, and driven by ``fwd_step``/``push_tensor``/``bwd_step``/
    ``pop_tensor``/``finish_part_of_bwd`` when used without a context.

    With ``offloaded_layers`` (any layers but the last, in any order), the ``i``-th of
    the ``m`` offloaded layers, counted from the first, takes the place of layer ``i``
    above: released at the forward of layer ``L - m + i``, reloaded at the backward of
    layer ``L - 1 - m + i``; its offload still starts at the forward of the next layer.

    Args:
        num_layers: layers per forward pass (``L``).
        num_offloaded_layers: layers to offload (``k``), ``0 <= k <= L - 1``; 1 by
            default, as ``get_cpu_offload_context``.
        offloaded_layers: which layers to offload instead of the first ``k`` (a
            :func:`~cpu_offload.offload_layers` policy's ``offload`` and
            ``checkpoint+offload`` layers); ``num_offloaded_layers`` is then ignored.
        keep_passes: of the forward passes in flight, the ``N`` whose backwards come
            next keep this schedule and the others are moved whole, all layers (NOTE
            [Moving a pass whole] in pass_schedule.py); None (default): every pass keeps it.
        retain_pinned_cpu_buffers, offload_stream, device, min_offload_numel,
            min_offload_bytes, max_host_bytes: as for :class:`OffloadSynchronizer`.
    """

    def __init__(
        self,
        num_layers: int,
        num_offloaded_layers: int = 1,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: Any = None,
        *,
        device: torch.device | str | None = None,
        min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL,
        min_offload_bytes: int = 0,
        max_host_bytes: int | str | None = None,
        offloaded_layers: Sequence[int] | None = None,
        keep_passes: int | None = None,
    ) -> None:
        _check_model_layers(num_layers)
        check_keep_passes(keep_passes)
        if offloaded_layers is not None:
            chosen = check_offloaded_layers(offloaded_layers, num_layers)
            num_offloaded_layers = len(chosen)
        if (
            isinstance(num_offloaded_layers, bool)
            or not isinstance(num_offloaded_layers, int)
            or not 0 <= num_offloaded_layers <= max_offloaded(num_layers)
        ):
            raise ValueError(
                "cpu_offload: num_layers (layers to offload) must be an int with "
                f"0 <= num_layers <= model_layers - 1 = {max_offloaded(num_layers)}, got "
                f"num_layers={num_offloaded_layers!r}, model_layers={num_layers}. The last "
                "layer is never offloaded; use manual_synchronization=True for other schedules."
            )
        super().__init__(
            num_layers,
            retain_pinned_cpu_buffers,
            offload_stream,
            device=device,
            min_offload_numel=min_offload_numel,
            min_offload_bytes=min_offload_bytes,
            max_host_bytes=max_host_bytes,
        )
        self.num_offloaded_layers = num_offloaded_layers
        self.offloaded_layers: list[int] = (
            chosen if offloaded_layers is not None else list(range(num_offloaded_layers))
        )
        self._offloaded = frozenset(self.offloaded_layers)
        # Per layer, the offloaded layers released at its forward and reloaded at its
        # backward (schedule.py).
        self.release_schedule: defaultdict[int, list[int]] = defaultdict(list)
        self.reload_schedule: defaultdict[int, list[int]] = defaultdict(list)
        for layer, (release, reload) in schedule_points(num_layers, self.offloaded_layers).items():
            self.release_schedule[release].append(layer)
            self.reload_schedule[reload].append(layer)
        self.set_keep_passes(keep_passes)

    def set_keep_passes(self, keep_passes: int | None) -> None:
        """Keep the per-layer schedule for the ``keep_passes`` passes in flight whose
        backwards come next and move the others whole, from the next pass on (None:
        every pass keeps it); NOTE [Moving a pass whole] in pass_schedule.py."""
        self.keep_passes = check_keep_passes(keep_passes)
        self.pass_schedule = (
            None if self.keep_passes is None else PassSchedule(self.keep_passes, self.stats)
        )

    def layer_is_offloaded(self, layer: int) -> bool:
        if layer in self._offloaded:
            return True
        current = self.current_pass
        return current is not None and current.moved_whole

    def _on_forward(self, forward_pass: ForwardPass, layer: int) -> None:
        if forward_pass.moved_whole:
            PassSchedule.on_forward(forward_pass, layer)
            return
        if layer >= 1 and layer - 1 in self._offloaded:
            forward_pass.state(layer - 1).start_offload()
        for released in self.release_schedule[layer]:
            forward_pass.state(released).release_activation_forward_gpu_memory()

    def _on_forward_end(self, forward_pass: ForwardPass) -> None:
        if forward_pass.moved_whole:
            PassSchedule.on_forward_end(forward_pass)
            return
        if not self.warn_if_nothing_moved or self.num_offloaded_layers == 0:
            return
        states = [forward_pass.state(layer) for layer in self.offloaded_layers]
        largest = max(state.largest_below_threshold for state in states)
        if largest and not any(state.num_offloaded_tensors for state in states):
            self.warn_if_nothing_moved = False  # once
            warn(
                f"cpu_offload: a forward pass offloaded nothing: every tensor its "
                f"{self.num_offloaded_layers} offloaded layers saved has fewer elements than "
                f"min_offload_numel={self.min_offload_numel} (the largest had {largest}). "
                "Pass a smaller min_offload_numel (0 moves every tensor) to offload them; on "
                "a GPU, copies this small cost more in launch time than they save. This "
                "warning is shown once.",
                UserWarning,
                stacklevel=4,
            )

    def _on_backward(self, forward_pass: ForwardPass, layer: int) -> None:
        if forward_pass.moved_whole:
            PassSchedule.on_backward(forward_pass, layer)
            return
        for reloaded in self.reload_schedule[layer]:
            state = forward_pass.state(reloaded)
            if state.state is LayerState.OFFLOAD_FINISHED:
                state.start_reload()
