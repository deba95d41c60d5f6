"""Device memory of a modeled accelerator, counted as PyTorch's caching allocator counts it.

NOTE [Modeled device memory]
    A block is allocated when the operator that creates it is issued, rounded up to the
    allocator's 512 bytes, and freed when the last reference to its memory dies (the
    storage's finalizer).  A block that another stream used, and that was handed to
    ``Tensor.record_stream`` for it, comes back only once that stream's work issued
    before the free has completed, *as the host sees it*: the allocator polls its events
    when it next allocates, and drains them at a synchronisation, so while the host runs
    ahead of the device such a block stays allocated.  ``memory_allocated`` is the sum of
    blocks allocated now, ``peak`` its maximum, and the curve has one point per change,
    at the device time of the allocating stream (where the work that uses the memory
    starts, or the work before the free ends).  Host memory (pinned or pageable) is
    tracked to tell copies' directions and rates; it is not device memory.  Pinned
    memory is counted as torch's caching host allocator holds it (NOTE [Modeled pinned
    memory] in pinned_memory.py).
    A freed device block goes back to its stream's pool, and a reuse that other streams'
    work on the old tensor is not ordered before raises (NOTE [Allocator reuse across
    streams] in allocator_pools.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..device.kernel_costs import storage_id
from .allocator_pools import FreedBlock, StreamOrder, StreamPools, Use
from .clocks import StreamClock, Timeline
from .pinned_memory import PinnedCache, round_threshold

__all__ = ["Block", "DeviceMemory", "MemoryMark"]

#: the caching allocator rounds every block up to a multiple of this many bytes
ROUND = 512


class Block:
    """One storage the model tracks: device memory, or host memory (pinned or pageable)."""

    __slots__ = (
        "size",
        "stream",
        "host",
        "pinned",
        "recorded",
        "finalizer",
        "what",
        "uses",
        "pool",
    )

    def __init__(self, size: int, stream: StreamClock, host: bool, pinned: bool) -> None:
        self.size = size
        self.stream = stream
        self.host = host
        self.pinned = pinned
        self.recorded: set[int] = set()  # ids of streams handed to record_stream
        self.finalizer: weakref.finalize | None = None
        self.what = ""  # the tensor it was allocated for, described
        self.uses: dict[Hashable, Use] = {}  # other streams' last work on it
        self.pool: Any = None  # the CUDA graph pool it came from (cuda_graphs.GraphPool)


@dataclass(frozen=True)
class MemoryMark:
    """Device memory at a point the program marked (``TimedReport.mark``).

    Attributes:
        label: the program's name for the point.
        time: the compute stream's time there (seconds).
        allocated: device bytes allocated then.
        counted: ``allocated`` less the blocks of the tensors the mark was told not to
            count (the hidden state handed to the next layer, gradients, ...).
    """

    label: str
    time: float
    allocated: int
    counted: int


class DeviceMemory:
    """The model's allocator count; see NOTE [Modeled device memory]."""

    def __init__(self, timeline: Timeline, streams: dict[int, StreamClock]) -> None:
        self.timeline = timeline
        self.streams = streams  # stream id -> clock (record_stream names a stream by id)
        self.blocks: dict[int, Block] = {}
        self.allocated = 0
        self.peak = 0
        self.peak_since_reset = 0  # torch.cuda.max_memory_allocated's
        self.host_allocated = 0  # host memory (pinned or pageable), counted apart
        self.host_peak = 0
        self.curve: list[tuple[float, int]] = []
        self.marks: list[MemoryMark] = []
        self.deferred: list[tuple[float, Block]] = []  # freed, awaiting recorded streams
        self.closed = False
        self.order = StreamOrder()
        self.pinned = PinnedCache(round_threshold())
        self.pools = StreamPools(self.order.ordered, "modeled_cuda")

    def block(self, tensor: torch.Tensor) -> Block | None:
        """The block of ``tensor``'s memory, if the model tracks it."""
        key = storage_id(tensor)
        return None if key is None else self.blocks.get(key)

    def track(
        self,
        tensor: torch.Tensor,
        stream: StreamClock,
        time: float,
        host: bool = False,
        pinned: bool = False,
    ) -> None:
        """A new storage: ``tensor``'s, allocated now by work issued on ``stream`` that
        starts at ``time``."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        held = self.pinned.allocate(size) if pinned else -(-size // ROUND) * ROUND
        block = Block(held, stream, host, pinned)
        if not host:
            block.what = f"a tensor (shape {tuple(tensor.shape)}, dtype {tensor.dtype})"
            capture = self.timeline.capture
            if capture is not None:
                block.pool = capture.allocation(stream, block.what)
            if block.pool is None:
                self.pools.allocate(stream, size, block.what, stream.name)
        self.blocks[key] = block
        block.finalizer = weakref.finalize(storage, self._died, key)
        block.finalizer.atexit = False
        if host:
            self.host_allocated += block.size
            self.host_peak = max(self.host_peak, self.host_allocated)
        elif block.pool is not None:  # device memory counts the pool's reserve
            block.pool.take(block.size, time)
        else:
            if self.deferred:
                self.poll()
            self.change(block.size, time)

    def record_stream(self, tensor: torch.Tensor, stream_id: int) -> None:
        """``tensor.record_stream(stream)``: its block waits for that stream when freed."""
        block = self.block(tensor)
        if block is not None and not block.host and stream_id in self.streams:
            block.recorded.add(stream_id)

    def _died(self, key: int) -> None:
        block = self.blocks.pop(key, None)
        if block is not None and block.host and not self.closed:
            self.host_allocated -= block.size
            if block.pinned:
                self.pinned.release(block.size)
        if block is None or block.host or self.closed:
            return
        if block.pool is not None:  # back to the graph's pool, which keeps its reserve
            block.pool.give(block.size, self.timeline.now(block.stream))
            return
        if block.recorded:
            # The allocator returns the block once the recorded streams' work issued
            # before the free completed, and with it all work that work was ordered after.
            recorded = [self.streams[s] for s in block.recorded]
            done: dict[Hashable, int] = {}
            for clock in recorded:
                for other, seq in self.order.stamp(clock).items():
                    done[other] = max(done.get(other, 0), seq)
            block.uses = {
                s: use for s, use in block.uses.items() if use.seq > done.get(use.stream, 0)
            }
            ready = max(clock.time for clock in recorded)
            if ready > self.timeline.host:
                self.deferred.append((ready, block))
                return
        self._release(block)

    def _release(self, block: Block) -> None:
        self.change(-block.size, self.timeline.now(block.stream))
        self.pools.free(
            block.stream, FreedBlock(block.size, block.stream.name, block.what, block.uses)
        )

    def in_graph_pool(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory came from a CUDA graph's pool."""
        block = self.block(tensor)
        return block is not None and block.pool is not None

    def use(self, tensor: object, clock: StreamClock, seq: int, op: str) -> None:
        """Work at ``seq`` on ``clock``'s stream reads or writes ``tensor``: noted on its
        block when another stream owns it."""
        if not isinstance(tensor, torch.Tensor):
            return
        capture = self.timeline.capture
        if capture is not None and clock in capture.streams:
            return  # a capture runs nothing (its replays use the memory: ``replayed``)
        key = storage_id(tensor)
        block = None if key is None else self.blocks.get(key)
        if block is not None and block.stream is not clock and not block.host:
            block.uses[clock] = Use(clock, clock.name, seq, op)

    def replayed(self, keys: Iterable[int], clock: StreamClock, seq: int, what: str) -> None:
        """A graph replayed on ``clock``'s stream at ``seq`` used the blocks of ``keys``."""
        for key in keys:
            block = self.blocks.get(key)
            if block is not None and block.stream is not clock and not block.host:
                block.uses[clock] = Use(clock, clock.name, seq, what)

    def poll(self) -> None:
        """Return the recorded blocks whose streams' work the host sees completed."""
        host, waiting = self.timeline.host, []
        for ready, block in self.deferred:
            if ready <= host:
                self._release(block)
            else:
                waiting.append((ready, block))
        self.deferred = waiting

    def change(self, nbytes: int, time: float) -> None:
        allocated = self.allocated = self.allocated + nbytes
        if allocated > self.peak_since_reset:
            self.peak_since_reset = allocated
            if allocated > self.peak:
                self.peak = allocated
        self.curve.append((time, allocated))

    def mark(self, label: str, not_counted: Iterable[object], compute: StreamClock) -> MemoryMark:
        """Note the memory now, less the distinct blocks of the ``not_counted`` tensors."""
        seen: set[int] = set()
        excluded = 0
        for tensor in not_counted:
            if not isinstance(tensor, torch.Tensor):
                continue
            key = storage_id(tensor)
            if key is None or key in seen:
                continue
            block = self.blocks.get(key)
            if block is not None and not block.host:
                seen.add(key)
                excluded += block.size
        mark = MemoryMark(
            label, self.timeline.now(compute), self.allocated, self.allocated - excluded
        )
        self.marks.append(mark)
        return mark

    def close(self) -> None:
        """The run is over: later deaths are not counted (the program may keep tensors)."""
        self.closed = True
        for block in self.blocks.values():
            if block.finalizer is not None:
                block.finalizer.detach()
        self.blocks.clear()
