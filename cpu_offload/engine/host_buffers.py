"""Host buffers that offloaded tensors are copied into.

NOTE [Host memory pool]
    Pinned host memory is the scarcest memory of a training node and allocating it
    is slow (``cudaHostAlloc`` takes milliseconds and synchronises), so buffers are
    reused.  Shapes change from step to step (packed or variable-length batches),
    so the pool does not cache by layout: it holds byte blocks in fine size classes
    and hands out views of them with the requested shape, strides and dtype.

    * Size classes: :data:`CLASS_DIVISIONS` (16) per power of two, as the CUDA
      caching allocator's ``roundup_power2_divisions``, on a 4 KiB page grain: a
      block wastes at most 1/16 of what it serves (6.25%; power-of-two classes
      wasted up to half, 1.46x the moved bytes at fixed shapes).
    * A request takes the smallest free block that is large enough, of any class
      (the largest tensors of a layer choose first), so the blocks of the largest
      step serve every smaller one (best fit never needs a block that a later,
      larger request could not use) and allocations stop once the largest shapes
      have been seen.
    * The pool holds at most :data:`RESERVE_RATIO` (1.2) times the largest number
      of bytes that were in use at once, or what is in use where that is more:
      before a new block would exceed that, free blocks are freed, largest first.
      With fixed shapes nothing is ever freed (the blocks in use fit under the
      bound); with varying shapes a larger step replaces the blocks it cannot use.
    * Blocks are sized as torch's pinned allocator holds them (NOTE [Pinned sizes
      as torch holds them] in device/pinned_sizes.py: its rounding threshold is set,
      so a class above 1 MiB is held at its size), so ``reserved_bytes`` is what
      torch holds.  A pool miss is one ``empty_host_bytes``: one ``cudaHostAlloc``
      (about 3 ms); freed blocks go back to the OS (torch's host cache is emptied
      after them).  A hit is a dictionary lookup and a view.  The step report counts
      the misses of each step (``host_allocations``): 0 at fixed shapes after the
      first step.
    * Blocks come back when the layer's data is dropped, after the compute stream
      has waited for the layer's copies; every copy into or out of a pool runs on
      its synchronizer's one offload stream, so a block's next copy is ordered after
      its previous one.

    With ``retain=True`` each layer keeps its own buffers with fixed addresses
    instead (CUDA graph capture needs them); their layouts must stay the same.

    With ``max_bytes`` (``max_host_bytes``: eight ranks share one host's pinned
    memory) the pool never reserves more: free blocks are freed first, and a tensor
    that still does not fit gets no buffer and stays on the device (counted in the
    statistics, with one warning).

NOTE [A host that says no]
    A host allocation can fail: host memory runs out, pinned pages pass
    ``RLIMIT_MEMLOCK`` or a cgroup's limit.  The pool then treats what it reserved
    as its cap from there on (free blocks are evicted to make room, nothing more is
    asked of the host), and the tensor that asked stays on the device, as one over
    ``max_bytes`` does: counted (``stats.host_allocations_failed``, and the tensor in
    ``stats.tensors_kept_by_host_cap`` and the step report's ``host_cap`` reason), with
    one warning naming the cap to set.  A step never fails for it.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import cast

import torch

from ..device.backend import DeviceBackend
from ..device.pinned_sizes import held_size
from ..errors import CpuOffloadError
from ..log import warn
from ..report.stats import OffloadStats

__all__ = ["HostBufferPool", "pool_reserve", "size_class"]


Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]

#: The smallest block and the grain of every class: a page.
MIN_BLOCK_BYTES = 4096
#: size classes per power of two (a block wastes at most 1/16 of its request)
CLASS_DIVISIONS = 16
#: the most the pool keeps, as a multiple of the most bytes ever in use at once
RESERVE_RATIO = 1.2


def _layout(tensor: torch.Tensor) -> Layout:
    return tuple(tensor.shape), tensor.stride(), tensor.dtype


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a dense tensor's elements (its strides may permute them)."""
    return tensor.numel() * tensor.element_size()


def size_class(nbytes: int) -> int:
    """The block size that serves ``nbytes``: ``nbytes`` rounded up to a multiple of
    1/:data:`CLASS_DIVISIONS` of the power of two below it, and of ``MIN_BLOCK_BYTES``.

    Example:
        >>> size_class(1), size_class(5000), size_class(3 * 2**20 + 1) - 3 * 2**20
        (4096, 8192, 131072)
    """
    if nbytes <= MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    grain = max(MIN_BLOCK_BYTES, (1 << ((nbytes - 1).bit_length() - 1)) // CLASS_DIVISIONS)
    return -(-nbytes // grain) * grain


def pool_reserve(nbytes: int) -> int:
    """The most the pool reserves for ``nbytes`` of tensors of 64 KiB or more at once
    (each block within 1/:data:`CLASS_DIVISIONS` of its tensor): what a plan must
    leave under ``max_host_bytes``.  Works on numpy arrays too."""
    return nbytes + nbytes // CLASS_DIVISIONS


class _Block:
    """A byte block of the pool and the view it last served (reused for the same layout)."""

    __slots__ = ("data", "size", "view", "layout", "asked")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.size = data.numel()
        self.asked = 0  # while lent: the bytes the view asks for
        self.view: torch.Tensor | None = None
        self.layout: Layout | None = None  # the view's, read once

    def view_as(self, layout: Layout, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes seen with the shape, strides and dtype ``layout``."""
        if layout == self.layout:
            return cast(torch.Tensor, self.view)
        shape, stride, dtype = layout
        view = self.data[:nbytes].view(dtype).as_strided(shape, stride)
        self.view, self.layout = view, layout
        return view


#: why a pool's ``retain`` buffers keep their layouts, and the fix: the error of a layer
#: whose layouts changed says both (a CUDA graph's pool says its own)
RETAIN_FIXED = (
    "retain_pinned_cpu_buffers=True keeps each layer's host buffers for the next pass",
    "Keep shapes (sequence length, batch size) fixed between iterations, or pass "
    "retain_pinned_cpu_buffers=False.",
)


class HostBufferPool:
    """Hands out host buffers to layers and takes them back when their data goes.

    See NOTE [Host memory pool].  :meth:`stats` reports the footprint;
    :meth:`empty_cache` frees the blocks no layer is using.

    Args:
        backend: allocates the blocks (pinned where the device supports it).
        retain: keep each layer's buffers for the same layer of later passes.
        max_bytes: the most the pool may reserve (None: no cap).
        stats: where tensors refused by the cap are counted.
    """

    fixed = RETAIN_FIXED  # why retained buffers keep their layouts, and the fix

    def __init__(
        self,
        backend: DeviceBackend,
        retain: bool,
        max_bytes: int | None = None,
        stats: OffloadStats | None = None,
    ) -> None:
        self._backend = backend
        self.retain = retain
        self.max_bytes = max_bytes
        self._stats = stats if stats is not None else OffloadStats()
        self._warned_cap = False
        #: bytes reserved when the host refused an allocation: the pool holds there
        self._host_full: int | None = None
        # Free blocks by size class, and the sorted classes that have one, so lending
        # and taking back cost O(classes), not O(blocks).
        self._free_sizes: list[int] = []
        self._free: defaultdict[int, list[_Block]] = defaultdict(list)
        self._lent: dict[int, _Block] = {}  # id(view) -> its block (and the bytes asked)
        self._retained: defaultdict[int, list[list[torch.Tensor | None]]] = defaultdict(list)
        self._reserved = self._in_use = 0
        self._requested = 0  # bytes the views in use ask for
        self._peak_requested = 0
        self._num_alloc = self._num_free = 0
        self._threshold: int | None = -1  # the backend's host_round_threshold (-1: unasked)
        # Passes of several threads share the pool.  Re-entrant: a garbage collection
        # inside ``acquire`` may run a layer's finalizer, which gives its buffers back.
        self._lock = threading.RLock()

    @property
    def may_refuse(self) -> bool:
        """Whether :meth:`acquire` may give a tensor no buffer: under ``max_bytes``, or
        once the host refused an allocation (NOTE [A host that says no])."""
        return self.max_bytes is not None or self._host_full is not None

    # -------------------------------------------------------------- lending

    def acquire(
        self,
        layer_index: int,
        tensors: list[torch.Tensor],
        sizes: list[int] | None = None,
        layouts: Sequence[Layout] | None = None,
    ) -> list[torch.Tensor | None]:
        """Host buffers with the layouts of ``tensors`` (dense), for layer ``layer_index``;
        ``None`` for a tensor that does not fit under ``max_bytes``.  ``sizes``: the
        tensors' bytes, and ``layouts``: their ``(shape, stride, dtype)``, where the
        caller has them."""
        with self._lock:
            return self._acquire(layer_index, tensors, sizes, layouts)

    def _acquire(
        self,
        layer_index: int,
        tensors: list[torch.Tensor],
        sizes: list[int] | None,
        layouts: Sequence[Layout] | None,
    ) -> list[torch.Tensor | None]:
        if self.retain and self._retained[layer_index]:
            # Checked before it is taken: after the error the set is still the layer's.
            _check_same_layout(layer_index, self._retained[layer_index][-1], tensors, self.fixed)
            return self._retained[layer_index].pop()
        if sizes is None:
            sizes = [_nbytes(t) for t in tensors]
        self._requested += sum(sizes)
        self._peak_requested = max(self._peak_requested, self._requested)
        buffers: list[torch.Tensor | None] = [None] * len(tensors)
        # Largest first: the largest tensors get the blocks that fit them best.
        order = sorted(range(len(tensors)), key=sizes.__getitem__, reverse=True)
        free_sizes, free, lent = self._free_sizes, self._free, self._lent
        for position in order:  # the smallest free block large enough, else a new one
            nbytes = sizes[position]
            at = bisect.bisect_left(free_sizes, nbytes)
            if at < len(free_sizes):
                size = free_sizes[at]
                blocks = free[size]
                block: _Block | None = blocks.pop()
                if not blocks:
                    del free_sizes[at]
                self._in_use += size
            else:
                block = self._new_block(nbytes)
            if block is None:  # over max_bytes: this tensor stays on the device
                self._requested -= nbytes
                self._refuse(nbytes)
                continue
            if layouts is None:
                like = tensors[position]
                layout: Layout = (like.shape, like.stride(), like.dtype)
            else:
                layout = layouts[position]
            if layout == block.layout:  # (the common case, without a call)
                view = cast(torch.Tensor, block.view)
            else:
                view = block.view_as(layout, nbytes)
            lent[id(view)] = block
            block.asked = nbytes
            buffers[position] = view
        return buffers

    def release(self, layer_index: int, buffers: list[torch.Tensor | None]) -> None:
        """Give back the buffers of ``layer_index`` once their data is no longer needed."""
        if not buffers:
            return
        with self._lock:
            self._release(layer_index, buffers)

    def _release(self, layer_index: int, buffers: list[torch.Tensor | None]) -> None:
        if self.retain:
            self._retained[layer_index].append(buffers)  # still lent: fixed addresses
            return
        free_sizes, free, lent = self._free_sizes, self._free, self._lent
        requested = in_use = 0
        for view in buffers:
            if view is not None:
                block = lent.pop(id(view))
                requested += block.asked
                size = block.size
                in_use += size
                blocks = free[size]
                if not blocks:
                    bisect.insort(free_sizes, size)
                blocks.append(block)
        self._requested -= requested
        self._in_use -= in_use

    def empty_cache(self) -> None:
        """Free the blocks no layer is using (and the buffers retained for later passes)."""
        with self._lock:
            self._empty_cache()

    def _empty_cache(self) -> None:
        for size in self._free_sizes:
            for _ in self._free[size]:
                self._count_freed(size)
        self._free_sizes.clear()
        self._free.clear()
        for sets in self._retained.values():
            for buffers in sets:
                for view in buffers:
                    if view is not None:
                        self._count_freed(self._take_back(view).size)
        self._retained.clear()
        self._backend.empty_host_cache()

    def stats(self) -> dict[str, int]:
        """Host memory of this pool, in bytes and counts.

        ``reserved_bytes``: held by the pool, in use or free; ``in_use_bytes``: in
        blocks lent to layers; ``requested_bytes``: what the lent buffers ask for;
        ``peak_requested_bytes``: the most that was asked for at once;
        ``num_host_alloc`` / ``num_host_free``: blocks allocated and freed so far.
        """
        return {
            "reserved_bytes": self._reserved,
            "in_use_bytes": self._in_use,
            "requested_bytes": self._requested,
            "peak_requested_bytes": self._peak_requested,
            "num_host_alloc": self._num_alloc,
            "num_host_free": self._num_free,
        }

    def usage(self) -> tuple[int, int]:
        """``(reserved_bytes, in_use_bytes)`` of :meth:`stats`, for nearly nothing."""
        return self._reserved, self._in_use

    @property
    def allocations(self) -> int:
        """Host blocks allocated so far (pool misses): pinned, each one ``cudaHostAlloc``
        (NOTE [Pinned sizes as torch holds them])."""
        return self._num_alloc

    # ------------------------------------------------------------- blocks

    def _new_block(self, nbytes: int) -> _Block | None:
        """A new block for ``nbytes`` (no free one is large enough), or None where the
        cap or the host refuses it."""
        if self._threshold == -1:  # asked once, at the first block
            self._threshold = self._backend.host_round_threshold()
        size = held_size(size_class(nbytes), self._threshold)
        limits = [n for n in (self.max_bytes, self._host_full) if n is not None]
        if any(self._in_use + size > limit for limit in limits):
            return None  # refused before evicting: what later tensors of the step reuse stays
        freed = self._num_free  # (in retain mode nothing is free to evict)
        self._evict_for(size, int(RESERVE_RATIO * self._peak_requested))
        for limit in limits:
            self._evict_for(size, limit)
        if self._num_free != freed:  # NOTE [Pinned sizes as torch holds them]
            self._backend.empty_host_cache()
        try:
            data = self._backend.empty_host_bytes(size)
        except (RuntimeError, MemoryError) as error:  # NOTE [A host that says no]
            self._refused_by_host(size, error)
            return None
        block = _Block(data)
        self._reserved += size
        self._num_alloc += 1
        self._in_use += size
        return block

    def _evict_for(self, size: int, limit: int) -> None:
        """Free unused blocks, largest first, until ``size`` more bytes fit ``limit``."""
        while self._free_sizes and self._reserved + size > limit:
            largest = self._free_sizes[-1]
            blocks = self._free[largest]
            blocks.pop()
            if not blocks:
                self._free_sizes.pop()
            self._count_freed(largest)

    def _refuse(self, nbytes: int) -> None:
        self._stats.tensors_kept_by_host_cap += 1
        self._stats.bytes_kept_by_host_cap += nbytes
        if not self._warned_cap and self.max_bytes is not None:
            self._warned_cap = True
            _warn_capped(self.max_bytes, self._reserved)

    def _refused_by_host(self, size: int, error: BaseException) -> None:
        """The host would not give ``size`` more bytes: the pool holds at what it has,
        and the tensor stays on the device (NOTE [A host that says no])."""
        self._host_full = self._reserved
        self._stats.host_allocations_failed += 1
        if self._stats.host_allocations_failed == 1:
            _warn_host_refused(size, self._reserved, error)

    def _take_back(self, view: torch.Tensor) -> _Block:
        """The block behind a lent view, no longer counted as in use."""
        block = self._lent.pop(id(view))
        self._requested -= block.asked
        self._in_use -= block.size
        return block

    def _count_freed(self, size: int) -> None:
        self._reserved -= size
        self._num_free += 1


def _warn_host_refused(size: int, reserved: int, error: BaseException) -> None:
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    warn(
        f"cpu_offload: the host refused a {size / 2**20:.1f} MiB buffer ({reason}); the "
        f"pool keeps the {reserved / 2**20:.1f} MiB it holds, and saved tensors that do not "
        "fit stay on the device (counted in stats.tensors_kept_by_host_cap; gradients are "
        f"unchanged). Set max_host_bytes to what this rank may lock (at most {reserved} "
        "bytes here, or 'auto': the node's available memory shared by its ranks), or raise "
        "the limit that refused (RLIMIT_MEMLOCK, the cgroup's memory.max). This warning is "
        "shown once.",
        UserWarning,
        stacklevel=4,
    )


def _check_same_layout(
    layer_index: int,
    buffers: list[torch.Tensor | None],
    tensors: list[torch.Tensor],
    fixed: tuple[str, str],
) -> None:
    found = [_layout(t) for t in tensors]
    expected = [None if b is None else _layout(b) for b in buffers]
    if len(found) != len(expected) or any(
        e is not None and e != f for e, f in zip(expected, found)
    ):
        raise CpuOffloadError(
            f"cpu_offload: {fixed[0]}, but layer {layer_index} saved tensors with other "
            f"(shape, stride, dtype) than in the previous iteration: expected {expected}, "
            f"found {found}. {fixed[1]}"
        )


def _warn_capped(max_bytes: int, reserved: int) -> None:
    warn(
        f"cpu_offload: the host buffer pool is at max_host_bytes={max_bytes} "
        f"({max_bytes / 2**20:.1f} MiB; {reserved / 2**20:.1f} MiB reserved), "
        "so saved tensors that do not fit stay on the device (counted in "
        "stats.tensors_kept_by_host_cap; gradients are unchanged). Raise "
        "max_host_bytes or offload fewer layers to move them. This warning is "
        "shown once.",
        UserWarning,
        stacklevel=3,
    )
