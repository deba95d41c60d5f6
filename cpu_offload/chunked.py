"""A whole forward offloaded without a layer list: saved tensors grouped into chunks.

torchtune's and TRL's users write ``with OffloadActivations(): loss = model(batch)``
around a whole model, with no layer structure to hook.  :class:`ChunkedOffload` takes
that shape: one pack hook for the whole forward hands each saved tensor to the current
*chunk* (an :class:`~cpu_offload.engine.layer_state.OffloadableLayerState`), and a chunk closes
once it holds enough offloadable bytes.

NOTE [Chunks by bytes]
    Chunks are cut by bytes, not at module boundaries: the context sees saved tensors
    and nothing else (custom autograd Functions, functional code, compiled regions
    have no module to hook), and bytes are what a copy's time and the device's memory
    are made of.

    size:    by default a chunk closes, at the next tensor that moves, once it holds an
             eighth of the offloadable bytes saved before it in this forward, and at
             most :data:`MAX_CHUNK_BYTES`: the first chunks are single tensors, later
             ones grow with the forward.  What stays on the device at the end of
             forward (the last chunk) is then at most about an eighth of what the
             forward saved, plus one tensor, on a small forward as on a large one; the
             number of chunks grows with the logarithm of the forward's size.  A fixed
             ``chunk_bytes`` closes every chunk at that many bytes instead.
    forward: a chunk's copies start when the next chunk takes its first offloadable
             tensor, and its device memory is released (the compute stream waits for
             its copies) when the chunk after that starts, so a copy has a chunk of
             compute to hide behind.  The last chunk stays on the device, backward
             needs it first, unless (with growing chunks) it holds more than an eighth
             of the forward's offloadable bytes (one large tensor saved last, such as
             the logits a loss saves): then it moves as the context is left, its copy
             exposed, and at most an eighth of the forward stays on the device.
    backward: the first pop of a chunk starts the reload of the chunk before it, which
             backward needs next (and, for a last chunk that moved, its own).  A
             chunk's memory goes when autograd frees its saved tensors (NOTE
             [Lifetime of a layer's data] in layer_state.py).

NOTE [A tensor saved in several chunks]
    A tensor saved again after its chunk closed (q, k and v projections of one input,
    a loss that saves the logits again) is not copied again: the new save gets a
    handle to the copy already made, whose unpack checks the version recorded then
    (a tensor modified in place in between is pushed anew, as autograd would see two
    versions).  So is another view of the same storage (``out``, then ``out.t()``),
    when the tensor moved first covers its whole storage densely (so its copy holds
    every element where the storage held it): the handle rebuilds the view from the
    copy with ``as_strided``, as a chunk rebuilds a view from its base.  Such a handle
    does not prefetch: the chunk it points to is reloaded when its own tensors are
    first needed, or at once if this one comes first.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .device.amounts import integer
from .device.backend import is_dense
from .engine.layer_state import OffloadableLayerState
from .engine.offload_engine import ChunkedForward, ChunkEngine
from .engine.transitions import LayerState
from .errors import CpuOffloadError
from .hooks.autograd_hooks import (
    ActiveToken,
    enter_active,
    forward_inside_backward,
    leave_active,
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    saved_tensor_hooks_enabled,
)
from .hooks.eager import eager
from .hooks.handles import SharedHandle, unpack_saved
from .hooks.per_thread import PerThread
from .hooks.selection import is_offloadable
from .log import logger, warn
from .report.step_record import nominal_bytes
from .report.step_report import StepReport

__all__ = ["CHUNK_FRACTION", "MAX_CHUNK_BYTES", "ChunkedForward", "ChunkedOffload", "ChunkEngine"]

#: by default a chunk holds at least this fraction of the bytes saved before it ...
CHUNK_FRACTION = 1 / 8
#: ... and closes at this many offloadable bytes at most (NOTE [Chunks by bytes])
MAX_CHUNK_BYTES = 64 * 2**20

_Tensor = torch.Tensor


class _Forward:
    """One thread's forward under the context."""

    __slots__ = (
        "inert",
        "hooks",
        "depth_token",
        "record",
        "chunk",
        "chunk_bytes",
        "bytes_before",
        "copying",
        "seen",
        "storages",
        "saved",
        "moved_before",
    )

    def __init__(self) -> None:
        self.inert = False
        self.hooks = False  # the saved-tensor hooks are pushed
        self.depth_token: ActiveToken[int] | None = None
        self.record: ChunkedForward | None = None
        self.chunk: OffloadableLayerState | None = None  # taking tensors now
        self.chunk_bytes = 0  # offloadable bytes it holds
        self.bytes_before = 0  # offloadable bytes of the closed chunks
        self.copying: OffloadableLayerState | None = None  # closed, copies started, not released
        # id(tensor) -> (weak tensor, lease, index, version): moved tensors (NOTE [A
        # tensor saved in several chunks])
        self.seen: dict[int, tuple[weakref.ref[torch.Tensor], Any, int, int]] = {}
        # storage key -> the same, for moved tensors that cover their storage densely
        self.storages: dict[int, tuple[weakref.ref[torch.Tensor], Any, int, int]] = {}
        self.saved = 0  # tensors saved
        self.moved_before = 0  # stats.tensors_offloaded when the forward started


def _covers_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds every element of its storage once, from its start (so a
    copy of it with its layout holds the storage's elements where the storage did)."""
    return (
        tensor.storage_offset() == 0
        and is_dense(tensor)
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    )


def _saved_before(run: _Forward, chunk: OffloadableLayerState, tensor: _Tensor) -> Any:
    """A handle to the copy already made of ``tensor`` or of its storage (NOTE [A
    tensor saved in several chunks]), or None: push it."""
    view = None
    entry = run.seen.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        entry = run.storages.get(tensor.untyped_storage()._cdata)
        first = entry[0]() if entry is not None else None
        if first is None or first.dtype != tensor.dtype or first.device != tensor.device:
            return None
        if first.untyped_storage()._cdata != tensor.untyped_storage()._cdata:
            return None
        view = (tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))
    if entry is None or entry[3] != tensor._version:
        return None  # changed in place since: autograd sees another version
    lease = entry[1]
    if lease.layer is chunk:
        return chunk.push_tensor(tensor)  # the open chunk copies it once
    saves = chunk.saves  # its data went with the earlier chunk's, or stayed
    if lease.layer.went_to_host(lease, entry[2]):
        saves.moved += 1
        saves.moved_bytes += nominal_bytes(tensor)
    else:  # the host cap kept it there
        saves.capped += 1
        saves.capped_bytes += nominal_bytes(tensor)
    lease.layer.add_shared_pop(lease, entry[2])
    return SharedHandle(lease, entry[2], view)


def _prefetch(state: OffloadableLayerState) -> None:
    """Backward reached the chunk after ``state``: bring ``state`` back."""
    if state.state is LayerState.OFFLOAD_FINISHED:
        state.start_reload()


def _checked_chunk_bytes(chunk_bytes: object) -> int | None:
    whole = integer(chunk_bytes)
    if chunk_bytes is not None and (whole is None or whole < 1):
        raise ValueError(
            f"cpu_offload: chunk_bytes must be an int >= 1, or None (chunks that grow "
            f"with the forward), got {chunk_bytes!r}."
        )
    return whole


def _chunks(chunk_bytes: int | None) -> str:
    """How a repr says the chunks."""
    if chunk_bytes is not None:
        return f"chunks of {chunk_bytes} bytes"
    return (
        f"chunks growing with the forward to 1/{round(1 / CHUNK_FRACTION)} of it (at most "
        f"{MAX_CHUNK_BYTES // 2**20} MiB)"
    )


class ChunkedOffload:
    """Offload what a whole forward saves, in chunks; see the module.

    Args:
        chunk_bytes: offloadable bytes per chunk; by default (None) chunks grow with the
            forward, so that most of a small forward moves as most of a large one
            does (NOTE [Chunks by bytes]).
        device, min_offload_numel, min_offload_bytes, max_host_bytes,
            retain_pinned_cpu_buffers: as for :func:`cpu_offload.get_cpu_offload_context`.

    Attributes:
        offload_synchronizer: the context's :class:`ChunkEngine`: ``stats``,
            ``host_memory_stats()``, ``get_offloaded_total_size_mb()`` and
            ``in_flight_passes()`` (the forwards whose graphs are alive).

    Example:
        >>> import torch
        >>> from cpu_offload.chunked import ChunkedOffload
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
        >>> ctx = ChunkedOffload()
        >>> with ctx:
        ...     loss = model(torch.randn(16, 64, requires_grad=True)).sum()
        >>> ctx.offload_synchronizer.get_offloaded_total_size_mb() > 0
        True
        >>> loss.backward()
        >>> ctx.offload_synchronizer.stats.tensors_offloaded  # the 6 layers' inputs
        6
    """

    #: how messages name the threshold in bytes (torchtune's class calls it otherwise)
    bytes_threshold_name = "min_offload_bytes"

    def __init__(
        self,
        chunk_bytes: int | None = None,
        *,
        device: torch.device | str | None = None,
        min_offload_numel: int = 0,
        min_offload_bytes: int = 0,
        max_host_bytes: int | str | None = None,
        retain_pinned_cpu_buffers: bool = False,
    ) -> None:
        self.chunk_bytes = _checked_chunk_bytes(chunk_bytes)
        self.offload_synchronizer = ChunkEngine(
            retain_pinned_cpu_buffers,
            device=device,
            min_offload_numel=min_offload_numel,
            min_offload_bytes=min_offload_bytes,
            max_host_bytes=max_host_bytes,
        )
        self._forward = PerThread(_Forward)
        logger.info("%r", self)

    def report(self) -> StepReport:
        """What the last step did, per chunk: the tensors saved, moved and kept (and why),
        host and device memory (NOTE [What a step is] in step_report.py)."""
        return self.offload_synchronizer.report()

    def __repr__(self) -> str:
        engine = self.offload_synchronizer
        return (
            f"{type(self).__name__}(whole forward in {_chunks(self.chunk_bytes)}, the last "
            f"kept; {engine.thresholds(self.bytes_threshold_name)}; device {engine.backend.device})"
        )

    # ------------------------------------------------------------- context

    def __enter__(self) -> ChunkedOffload:
        run = self._forward.value
        if run.hooks or run.inert:
            raise CpuOffloadError(
                "cpu_offload: the offload context was entered again before it was left; "
                "enter it once around the forward (one `with` block per forward pass)."
            )
        run.inert = forward_inside_backward() or not saved_tensor_hooks_enabled()
        if run.inert:  # checkpoint recomputation, torch.func: nothing to offload
            return self
        engine = self.offload_synchronizer
        run.record = engine.new_forward()
        run.copying, run.bytes_before, run.saved = None, 0, 0
        run.moved_before = engine.stats.tensors_offloaded
        self._open_chunk(after=None)
        push_saved_tensor_hooks(self._push, unpack_saved)
        run.hooks = True
        run.depth_token = enter_active()
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        run = self._forward.value
        if run.inert:
            run.inert = False
            return
        if run.depth_token is not None:
            leave_active(run.depth_token)
        if run.hooks:
            pop_saved_tensor_hooks()
        if exc_type is None:
            if run.copying is not None:
                # The one before the last has had the last one's compute.
                run.copying.release_activation_forward_gpu_memory()
            self._move_a_large_last_chunk(run)
            self._warn_if_nothing_moved(run)
        if exc_type is None and run.record is not None and run.saved:
            # A step, reported when its graph goes, if a backward ran through it: the
            # first pop of each chunk says so; where nothing was pushed to move, nothing
            # tells, and it is reported anyway.
            if not (run.bytes_before or run.chunk_bytes):
                run.record.record.backward_ran = True
            self.offload_synchronizer.end_forward(run.record)
        # (after an exception the partial graph owns the chunks, and frees them with it)
        run.hooks = False
        run.depth_token = run.chunk = run.copying = run.record = None
        run.seen, run.storages = {}, {}

    # -------------------------------------------------------------- chunks

    @eager
    def _push(self, tensor: Any) -> Any:
        run = self._forward.value
        chunk = run.chunk
        if chunk is None:  # pragma: no cover - the hooks live only while a chunk is open
            raise CpuOffloadError("cpu_offload internal error: a push outside the context.")
        run.saved += 1
        if type(tensor) is _Tensor:
            shared = _saved_before(run, chunk, tensor)
            if shared is not None:
                return shared
        if self._full(run) and self._moves(tensor):
            chunk = self._close_chunk()  # a full chunk closes at the next tensor that moves
        handle = chunk.push_tensor(tensor)
        if type(handle) is tuple and len(handle) == 2:  # moved (NOTE [Handles])
            run.chunk_bytes += tensor.numel() * tensor.element_size()
            entry = (weakref.ref(tensor), handle[0], handle[1], tensor._version)
            run.seen[id(tensor)] = entry
            if _covers_its_storage(tensor):
                run.storages[tensor.untyped_storage()._cdata] = entry
        return handle

    def _full(self, run: _Forward) -> bool:
        """Whether the open chunk closes at the next tensor that moves."""
        held = run.chunk_bytes
        if self.chunk_bytes is not None:
            return held >= self.chunk_bytes
        return held > 0 and held >= min(MAX_CHUNK_BYTES, run.bytes_before * CHUNK_FRACTION)

    def _moves(self, tensor: Any) -> bool:
        engine = self.offload_synchronizer
        return type(tensor) is torch.Tensor and is_offloadable(
            tensor, engine.backend.device, engine.min_offload_numel, engine.min_offload_bytes
        )

    def _close_chunk(self) -> OffloadableLayerState:
        """Start the full chunk's copies, release the one before it, open the next."""
        run = self._forward.value
        full = run.chunk
        if full is None:  # pragma: no cover
            raise CpuOffloadError("cpu_offload internal error: no chunk to close.")
        full.start_offload()
        if run.copying is not None:
            run.copying.release_activation_forward_gpu_memory()
        run.copying = full
        run.bytes_before += run.chunk_bytes
        return self._open_chunk(after=full)

    def _open_chunk(self, after: OffloadableLayerState | None) -> OffloadableLayerState:
        run = self._forward.value
        if run.record is None:  # pragma: no cover
            raise CpuOffloadError("cpu_offload internal error: a chunk outside a forward.")
        state = self.offload_synchronizer.new_chunk(run.record)
        record = run.record.record
        # the graph owns chunks; a chunk only points back
        previous = weakref.ref(after) if after is not None else None

        def first_pop() -> None:
            record.backward_ran = True
            chunk = previous() if previous is not None else None
            if chunk is not None:
                _prefetch(chunk)

        state.on_first_pop = first_pop
        run.chunk, run.chunk_bytes = state, 0
        return state

    def _move_a_large_last_chunk(self, run: _Forward) -> None:
        """With growing chunks, a last chunk over an eighth of the forward moves too
        (NOTE [Chunks by bytes]); its first pop reloads it, then prefetches the one
        before it."""
        last = run.chunk
        held = run.chunk_bytes
        if (
            self.chunk_bytes is not None
            or last is None
            or not held
            or held <= CHUNK_FRACTION * (run.bytes_before + held)
            or not last.holds_data()  # (a backward inside the context freed it)
        ):
            return
        last.start_offload()
        last.release_activation_forward_gpu_memory()
        prefetch_previous = last.on_first_pop
        chunk = weakref.ref(last)

        def reload_then_prefetch() -> None:
            state = chunk()
            if state is not None:
                _prefetch(state)
            if prefetch_previous is not None:
                prefetch_previous()

        last.on_first_pop = reload_then_prefetch

    def _warn_if_nothing_moved(self, run: _Forward) -> None:
        """Say once why a forward moved nothing (every front end does something visible
        at its defaults, or says why not)."""
        engine = self.offload_synchronizer
        if not engine.warn_if_nothing_moved or not run.saved:
            return
        if engine.stats.tensors_offloaded > run.moved_before or run.bytes_before:
            return  # (chunks closed and moved nothing: max_host_bytes refused them, and says so)
        engine.warn_if_nothing_moved = False  # once
        name = type(self).__name__
        why = _why_nothing_moved(run, engine, self.chunk_bytes, self.bytes_threshold_name)
        warn(
            f"cpu_offload: {name} moved nothing to the host in a forward: {why} This "
            "warning is shown once.",
            UserWarning,
            stacklevel=3,
        )


def _why_nothing_moved(
    run: _Forward, engine: ChunkEngine, chunk_bytes: int | None, bytes_threshold_name: str
) -> str:
    """Why a forward under a whole-forward context moved nothing, and what to change."""
    if run.chunk_bytes:
        return (
            f"its offloadable tensors ({run.chunk_bytes / 2**20:.2f} MiB) fit in one "
            "chunk, the last, which stays on the device because backward needs it first"
            + (
                f". Pass a chunk_bytes under {chunk_bytes} to move them."
                if chunk_bytes is not None
                else " (a forward that saves one tensor large enough to move moves nothing)."
            )
        )
    else:
        limits = [
            f"{name}={value} {unit}"
            for name, value, unit in (
                ("min_offload_numel", engine.min_offload_numel, "elements"),
                (bytes_threshold_name, engine.min_offload_bytes, "bytes"),
            )
            if value
        ]
        return (
            f"none of the {run.saved} tensors it saved can move: each is "
            + (f"under {' or '.join(limits)}, " if limits else "")
            + "a parameter or a view of one, marked not to offload, not dense, or not "
            f"on {engine.backend.device}"
            + (". Lower the threshold to move smaller tensors." if limits else ".")
        )
