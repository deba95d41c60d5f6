"""Pinned host memory as torch's caching host allocator holds it, for the modeled accelerator.

NOTE [Modeled pinned memory]
    ``torch.empty(..., pin_memory=True)`` on a CUDA build goes through torch's
    ``CachingHostAllocator`` (``aten/src/ATen/core/CachingHostAllocator.h``).  In torch
    2.13 it rounds a request up to the next power of two (its free lists are indexed by
    that power), unless ``pinned_max_round_threshold_mb`` is set (``PYTORCH_ALLOC_CONF``
    or ``torch._C._accelerator_setAllocatorSettings``) and the request is larger than
    it: such a request is held at its size, aligned to 512 bytes.  A freed block goes to
    the free list of its size and serves the next request of that size; memory goes back
    to the OS only on ``empty_cache`` (:meth:`PinnedCache.empty_cache`).  Each block the
    cache could not serve is one ``cudaHostAlloc`` (about 3 ms, synchronising).

    :class:`PinnedCache` counts what the allocator holds (``reserved``: every block made,
    free or in use), what is in use, and how many blocks it had to make
    (``allocations``).  Under ``modeled_cuda`` a 600 MiB pinned tensor holds 1 GiB, as it
    does on a GPU.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import torch

__all__ = ["PinnedCache", "held_bytes", "round_threshold"]

#: the host allocator's alignment of a block it does not round to a power of two
ALIGNMENT = 512
_SETTING = re.compile(r"pinned_max_round_threshold_mb:\s*(\d+)")


def round_threshold() -> int | None:
    """The ``pinned_max_round_threshold_mb`` in force, in bytes (None: every request is
    rounded to a power of two, torch's default)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = getter() if getter is not None else ""
    for text in (settings, os.environ.get("PYTORCH_ALLOC_CONF", "")):
        found = _SETTING.search(text or "")
        if found:
            return int(found.group(1)) << 20
    return None


def held_bytes(nbytes: int, threshold: int | None) -> int:
    """What the host allocator holds for a request of ``nbytes``."""
    if nbytes <= 0:
        return 0
    if threshold is not None and nbytes > threshold:
        return -(-nbytes // ALIGNMENT) * ALIGNMENT
    return 1 << (nbytes - 1).bit_length()


class PinnedCache:
    """The blocks torch's caching host allocator holds (NOTE [Modeled pinned memory]).

    Args:
        threshold: ``pinned_max_round_threshold_mb`` in bytes, None when unset.
    """

    def __init__(self, threshold: int | None) -> None:
        self.threshold = threshold
        self.free: Counter[int] = Counter()  # held size -> free blocks
        self.reserved = 0  # every block made, free or in use
        self.peak_reserved = 0
        self.in_use = 0
        self.allocations = 0  # blocks made: cudaHostAlloc calls

    def allocate(self, nbytes: int) -> int:
        """A pinned request of ``nbytes``; returns the block's held size."""
        size = held_bytes(nbytes, self.threshold)
        if self.free[size]:
            self.free[size] -= 1
        else:
            self.allocations += 1
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.in_use += size
        return size

    def release(self, size: int) -> None:
        """A block of held ``size`` freed: cached for the next request of its size."""
        self.in_use -= size
        self.free[size] += 1

    def empty_cache(self) -> None:
        """The free blocks go back to the OS (``torch._C._accelerator_emptyHostCache``)."""
        self.reserved -= sum(size * count for size, count in self.free.items())
        self.free.clear()
