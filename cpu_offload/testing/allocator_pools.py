"""The caching allocator's per-stream pools, as the models of the device hold them.

NOTE [Allocator reuse across streams]
    PyTorch's caching allocator gives each block to the stream current at its
    allocation.  Freed, the block goes back to that stream's pool and the next
    allocation on that stream may take it at once: the allocator orders a reuse after
    the owning stream's own work only.  Work that *another* stream issued on the old
    tensor (a read by compute of a tensor made on a copy stream, a copy stream's write
    into a buffer that compute allocated) is ordered before the reuse only if the
    owning stream waited for it (an event, ``wait_stream``, a host synchronisation), or
    if the tensor was handed to ``Tensor.record_stream`` for that stream: the allocator
    then keeps the block out of the pool until that stream's work issued before the
    free has completed.

    :class:`StreamPools` holds the freed blocks of each stream, a small pool (blocks up
    to 1 MiB) and a large one, and hands a new allocation the smallest block of its pool
    that is large enough, splitting it as the allocator does.  Each block remembers the
    last use of every other stream (:class:`Use`); a new allocation that takes a block
    with a use its stream is not ordered after raises :class:`StreamHazardError`, naming
    the block's stream, the other stream, and both tensors.  A model answers "is this
    use ordered before work issued now on that stream" (``ordered``): the modeled
    accelerator with vector clocks (:class:`StreamOrder`), the strict simulator with its
    compute sequence numbers.

    What the allocator does that is not modeled: segments and their coalescing (freed
    neighbours merge into one block), ``max_split_size_mb``, and ``empty_cache``.  A
    reuse is flagged where the allocator's best fit *may* give the old block; a program
    that passes here is ordered for every block the allocator could hand out.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from ..errors import CpuOffloadError

__all__ = ["FreedBlock", "StreamHazardError", "StreamOrder", "StreamPools", "Use"]

#: blocks up to this size come from the allocator's small pool
SMALL = 1 << 20
#: the allocator's rounding of a block's size
ROUND = 512


class StreamHazardError(CpuOffloadError):
    """A stream-ordering mistake that would corrupt data on a real accelerator."""


@dataclass(frozen=True)
class Use:
    """The last work one stream issued on a block it does not own.

    Attributes:
        stream: the stream (as the model keys it).
        name: how messages name the stream.
        seq: the model's position of that work on the stream.
        op: what the work was (an operator, or a description).
    """

    stream: Hashable
    name: str
    seq: int
    op: object


@dataclass
class FreedBlock:
    """A block in its stream's pool.

    Attributes:
        size: its size in bytes (rounded as the allocator rounds).
        owner: how messages name the stream that owns it.
        what: the tensor it held, described.
        uses: the last use of each other stream.
    """

    size: int
    owner: str
    what: str
    uses: dict[Hashable, Use] = field(default_factory=dict)


def round_size(nbytes: int) -> int:
    """A request's size as the allocator rounds it."""
    return max(ROUND, -(-nbytes // ROUND) * ROUND)


class StreamPools:
    """The freed blocks of every stream (NOTE [Allocator reuse across streams]).

    Args:
        ordered: whether a :class:`Use` is ordered before work issued now on a stream.
        where: the prefix of messages (``"modeled_cuda"``, ``"strict_streams"``).
    """

    def __init__(self, ordered: Callable[[Use, Hashable], bool], where: str) -> None:
        self.ordered = ordered
        self.where = where
        # (stream, is_small) -> sorted (size, order, block)
        self.pools: dict[tuple[Hashable, bool], list[tuple[int, int, FreedBlock]]] = {}
        self._order = itertools.count()
        self.reuses = 0

    def free(self, stream: Hashable, block: FreedBlock) -> None:
        """``block``, owned by ``stream``, goes back to its pool."""
        pool = self.pools.setdefault((stream, block.size <= SMALL), [])
        bisect.insort(pool, (block.size, next(self._order), block))

    def allocate(self, stream: Hashable, nbytes: int, what: str, on: str) -> None:
        """A new tensor of ``nbytes`` (``what``) allocated on ``stream`` (named ``on``):
        the block it may take from the pool must have no unordered use."""
        size = round_size(nbytes)
        small = size <= SMALL
        pool = self.pools.get((stream, small))
        if not pool:
            return
        index = bisect.bisect_left(pool, (size, -1))
        if index == len(pool):
            return  # a new segment
        _, _, block = pool.pop(index)
        self.reuses += 1
        rest = block.size - size
        if rest >= (ROUND if small else SMALL + 1):  # the allocator splits the block
            self.free(stream, FreedBlock(rest, block.owner, block.what, dict(block.uses)))
        for use in block.uses.values():
            if not self.ordered(use, stream):
                self.hazard(block, use, what, on)

    def hazard(self, block: FreedBlock, use: Use, what: str, on: str) -> None:
        raise StreamHazardError(
            f"{self.where}: {what}, allocated on {on}, reuses the block of {block.what} "
            f"(the pool of {block.owner}) while {use.name}'s {use.op} of that tensor is "
            f"pending and not ordered before it: the allocator orders a reuse after "
            f"{block.owner}'s own work only.  Call record_stream({use.name}) on the tensor "
            f"before it is freed, or make {on} wait for {use.name} (an event, "
            "wait_stream) before the new allocation."
        )


class StreamOrder:
    """Happens-before between the streams of the modeled accelerator: a vector clock per
    stream (what it has waited for of each other stream) and a floor (what the host has
    seen completed)."""

    def __init__(self) -> None:
        self.issued: dict[Hashable, int] = {}
        self.known: dict[Hashable, dict[Hashable, int]] = {}
        self.floor: dict[Hashable, int] = {}

    def tick(self, stream: Hashable) -> int:
        """One more piece of work on ``stream``; its position."""
        seq = self.issued[stream] = self.issued.get(stream, 0) + 1
        return seq

    def stamp(self, stream: Hashable) -> dict[Hashable, int]:
        """An event recorded on ``stream`` now: what work completes before it."""
        stamp = dict(self.known.get(stream, ()))
        stamp[stream] = self.issued.get(stream, 0)
        return stamp

    def wait(self, stream: Hashable, stamp: dict[Hashable, int]) -> None:
        """``stream`` waits for an event."""
        known = self.known.setdefault(stream, {})
        for other, seq in stamp.items():
            if known.get(other, 0) < seq:
                known[other] = seq

    def host_saw(self, stamp: dict[Hashable, int]) -> None:
        """The host waited for an event: later work on every stream is after it."""
        for other, seq in stamp.items():
            if self.floor.get(other, 0) < seq:
                self.floor[other] = seq

    def host_saw_all(self) -> None:
        """A device synchronisation."""
        self.host_saw(self.issued)

    def ordered(self, use: Use, stream: Hashable) -> bool:
        """Whether ``use`` completes before work issued now on ``stream``."""
        if use.stream == stream or self.floor.get(use.stream, 0) >= use.seq:
            return True
        return self.known.get(stream, {}).get(use.stream, 0) >= use.seq
