"""A whole forward offloaded without a layer list: saved tensors grouped into chunks.

torchtune's and TRL's users write ``with OffloadActivations(): loss = model(batch)``
around a whole model, with no layer structure to hook.  :class:`ChunkedOffload` takes
that shape: one pack hook for the whole forward hands each saved tensor to the current
*chunk* (an :class:`~cpu_offload.layer_state.OffloadableLayerState`), and a chunk closes
once it holds ``chunk_bytes`` of offloadable tensors.

NOTE [Chunks by bytes]
    Chunks are cut by bytes, not at module boundaries: the context sees saved tensors
    and nothing else (custom autograd Functions, functional code, compiled regions
    have no module to hook), and bytes are what a copy's time and the device's memory
    are made of, so equal chunks give copies of equal length to hide.

    forward: a chunk's copies start when the next chunk takes its first offloadable
             tensor, and its device memory is released (the compute stream waits for
             its copies) when the chunk after that starts, so a copy has a chunk of
             compute to hide behind.  The last chunk stays on the device, as
             torchtune keeps it: backward needs it first.
    backward: the first pop of a chunk starts the reload of the chunk before it, which
             backward needs next.  A chunk's memory goes when autograd frees its
             saved tensors (NOTE [Lifetime of a layer's data] in layer_state.py).
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from .context import _active_depth, _forward_inside_backward, _saved_tensors_hooks_enabled
from .eager import eager
from .errors import CpuOffloadError
from .layer_state import LayerState, OffloadableLayerState, is_moved_handle, unpack_saved
from .per_thread import PerThread
from .selection import is_offloadable
from .synchronizer import OffloadSynchronizer

__all__ = ["DEFAULT_CHUNK_BYTES", "ChunkedOffload"]

#: the bytes of offloadable tensors per chunk, by default
DEFAULT_CHUNK_BYTES = 64 * 2**20


class _Forward:
    """One thread's forward under the context."""

    __slots__ = (
        "inert",
        "hooks",
        "depth_token",
        "chunk",
        "chunk_bytes",
        "copying",
        "chunks",
        "name",
    )

    def __init__(self) -> None:
        self.inert = False
        self.hooks: saved_tensors_hooks | None = None
        self.depth_token: contextvars.Token[int] | None = None
        self.chunk: OffloadableLayerState | None = None  # taking tensors now
        self.chunk_bytes = 0  # offloadable bytes it holds
        self.copying: OffloadableLayerState | None = None  # closed, copies started, not released
        self.chunks = 0
        self.name = ""


def _prefetch(state: OffloadableLayerState) -> None:
    """Backward reached the chunk after ``state``: bring ``state`` back."""
    if state.state is LayerState.OFFLOAD_FINISHED:
        state.start_reload()


class ChunkedOffload:
    """Offload what a whole forward saves, in chunks of ``chunk_bytes``; see the module.

    Args:
        chunk_bytes: offloadable bytes per chunk (see NOTE [Chunks by bytes]).
        device, min_offload_numel, min_offload_bytes, max_host_bytes,
            retain_pinned_cpu_buffers: as for :func:`cpu_offload.get_cpu_offload_context`.

    Attributes:
        offload_synchronizer: holds the stream, the host buffer pool (``host_memory_stats()``)
            and the statistics (``stats``) of every forward run under the context.

    Example:
        >>> import torch
        >>> from cpu_offload.chunked import ChunkedOffload
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
        >>> ctx = ChunkedOffload(chunk_bytes=4096, min_offload_numel=0)
        >>> with ctx:
        ...     loss = model(torch.randn(16, 64, requires_grad=True)).sum()
        >>> loss.backward()
        >>> ctx.offload_synchronizer.stats.tensors_offloaded > 0
        True
    """

    def __init__(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        device: torch.device | str | None = None,
        min_offload_numel: int = 0,
        min_offload_bytes: int = 0,
        max_host_bytes: int | None = None,
        retain_pinned_cpu_buffers: bool = False,
    ) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"cpu_offload: chunk_bytes must be an int >= 1, got {chunk_bytes!r}.")
        self.chunk_bytes = chunk_bytes
        self.offload_synchronizer = OffloadSynchronizer(
            1,
            retain_pinned_cpu_buffers,
            device=device,
            min_offload_numel=min_offload_numel,
            min_offload_bytes=min_offload_bytes,
            max_host_bytes=max_host_bytes,
        )
        self._forward = PerThread(_Forward)

    # ------------------------------------------------------------- context

    def __enter__(self) -> ChunkedOffload:
        run = self._forward.value
        if run.hooks is not None or run.inert:
            raise CpuOffloadError(
                "cpu_offload: the offload context was entered again before it was left; "
                "enter it once around the forward (one `with` block per forward pass)."
            )
        run.inert = _forward_inside_backward() or not _saved_tensors_hooks_enabled()
        if run.inert:  # checkpoint recomputation, torch.func: nothing to offload
            return self
        synchronizer = self.offload_synchronizer
        synchronizer.stats.forward_passes += 1
        run.name = f"forward pass {synchronizer.stats.forward_passes - 1}"
        run.chunks, run.copying = 0, None
        self._open_chunk(after=None)
        hooks = saved_tensors_hooks(self._push, unpack_saved)
        hooks.__enter__()
        run.hooks = hooks
        run.depth_token = _active_depth.set(_active_depth.get() + 1)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        run = self._forward.value
        if run.inert:
            run.inert = False
            return
        if run.depth_token is not None:
            _active_depth.reset(run.depth_token)
        if run.hooks is not None:
            run.hooks.__exit__(exc_type, exc, traceback)
        if exc_type is None and run.copying is not None:
            # The last chunk stays; the one before it has had the last one's compute.
            run.copying.release_activation_forward_gpu_memory()
        # (after an exception the partial graph owns the chunks, and frees them with it)
        run.hooks = run.depth_token = run.chunk = run.copying = None

    # -------------------------------------------------------------- chunks

    @eager
    def _push(self, tensor: Any) -> Any:
        run = self._forward.value
        chunk = run.chunk
        if chunk is None:  # pragma: no cover - the hooks live only while a chunk is open
            raise CpuOffloadError("cpu_offload internal error: a push outside the context.")
        if run.chunk_bytes >= self.chunk_bytes and self._moves(tensor):
            chunk = self._close_chunk()  # a full chunk closes at the next tensor that moves
        handle = chunk.push_tensor(tensor)
        if is_moved_handle(handle):
            run.chunk_bytes += tensor.numel() * tensor.element_size()
        return handle

    def _moves(self, tensor: Any) -> bool:
        synchronizer = self.offload_synchronizer
        return type(tensor) is torch.Tensor and is_offloadable(
            tensor,
            synchronizer.backend.device,
            synchronizer.min_offload_numel,
            synchronizer.min_offload_bytes,
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
        return self._open_chunk(after=full)

    def _open_chunk(self, after: OffloadableLayerState | None) -> OffloadableLayerState:
        run = self._forward.value
        synchronizer = self.offload_synchronizer
        state = OffloadableLayerState(
            synchronizer.offload_stream,
            layer_index=run.chunks,
            backend=synchronizer.backend,
            host_buffers=synchronizer.host_buffers,
            min_offload_numel=synchronizer.min_offload_numel,
            min_offload_bytes=synchronizer.min_offload_bytes,
            stats=synchronizer.stats,
            name=f"chunk {run.chunks} of {run.name}",
            copy_timer=synchronizer.copy_timer,
        )
        state.reload_advice = None  # a chunk backward reaches out of order reloads silently
        if after is not None:
            previous = weakref.ref(after)  # the graph owns chunks; a chunk only points back

            def prefetch() -> None:
                chunk = previous()
                if chunk is not None:
                    _prefetch(chunk)

            state.on_first_pop = prefetch
        run.chunks += 1
        run.chunk, run.chunk_bytes = state, 0
        return state
