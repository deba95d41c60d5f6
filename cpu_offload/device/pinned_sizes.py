"""Pinned host blocks at the sizes torch's caching host allocator holds them.

NOTE [Pinned sizes as torch holds them]
    ``torch.empty(n, pin_memory=True)`` goes through torch's ``CachingHostAllocator``,
    which rounds ``n`` up to a power of two unless ``pinned_max_round_threshold_mb`` is
    set and ``n`` is above it (torch 2.13; then the block is ``n`` aligned to 512 bytes),
    and which keeps every freed block cached until its ``empty_cache``.  The host pool
    (NOTE [Host memory pool]) cuts its blocks at 16 classes per power of two, so torch
    held 1.31x of what a step moved where the pool counted 1.02x.

    Why exact sizes, and not slabs that the pool carves: a slab is itself one pinned
    request, rounded to a power of two, and the pool learns what a step needs only by
    living through it.  In the first step of 6 x (1024 -> 3000 -> 1024) layers, 4096
    rows, each offloaded layer asks for 48 + 48 + 16 MiB; however power-of-two slabs
    are cut without knowing that 4 layers follow, they hold 512 MiB or more for the
    448 MiB the step needs (1.17x of the 439 MiB moved), and re-cutting them later
    leaves the first slabs in torch's cache.  So the pool asks torch not to round:
    where no threshold is in force, :func:`exact_pinned_sizes` sets
    ``pinned_max_round_threshold_mb`` to :data:`THRESHOLD_MB` (1), and the pool sizes
    each block as :func:`held_size` says torch holds it (blocks above 1 MiB at their
    class, at most 1/16 over their tensor; smaller ones at a power of two).  Its own
    count is then torch's count.  A threshold the user set is left as it is.  The
    setting is process-wide; it only makes torch hold less for larger pinned requests.

    A block the pool frees (evicted for a larger step, or ``empty_cache``) would stay
    in torch's cache, held, and serve only a request of its exact size: the pool then
    empties torch's host cache (:func:`empty_pinned_cache`), so that what torch holds
    stays what the pool counts, and every pool miss is one ``cudaHostAlloc``.
"""

from __future__ import annotations

import re
import types
from typing import Any

import torch

from ..log import logger

__all__ = ["THRESHOLD_MB", "empty_pinned_cache", "exact_pinned_sizes", "held_size"]

#: the rounding threshold the pool sets where none is in force, in MiB
THRESHOLD_MB = 1
#: torch's alignment of a host block it does not round to a power of two
HOST_ALIGNMENT = 512
_SETTING = re.compile(r"pinned_max_round_threshold_mb:\s*(\d+)")


def held_size(nbytes: int, threshold: int | None) -> int:
    """What torch's host allocator holds for a pinned request of ``nbytes``, where
    ``threshold`` (bytes) is the rounding threshold in force (None: none, every
    request rounds to a power of two).

    Example:
        >>> held_size(3 << 20, None) >> 20, held_size((3 << 20) + 1, 1 << 20) - (3 << 20)
        (4, 512)
    """
    if nbytes <= 0:
        return 0
    if threshold is not None and nbytes > threshold:
        return -(-nbytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
    return 1 << (nbytes - 1).bit_length()


def _threshold_in_force() -> int | None:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    found = _SETTING.search(getter() if getter is not None else "")
    return int(found.group(1)) << 20 if found else None


def exact_pinned_sizes(runtime: Any) -> int | None:
    """The rounding threshold of ``runtime``'s pinned allocator, in bytes, after
    setting it to :data:`THRESHOLD_MB` where none is in force (NOTE [Pinned sizes as
    torch holds them]); None where every request is rounded to a power of two.

    A simulated runtime answers for itself (its ``exact_pinned_sizes``); one that
    does not is left alone (None)."""
    own = getattr(runtime, "exact_pinned_sizes", None)
    if own is not None:
        return own()  # type: ignore[no-any-return]
    available = getattr(runtime, "is_available", None)
    if not isinstance(runtime, types.ModuleType) or available is None or not available():
        return None  # not a runtime that pins here: the process's setting is left alone
    threshold = _threshold_in_force()
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if threshold is None and setter is not None:
        setter(f"pinned_max_round_threshold_mb:{THRESHOLD_MB}")
        threshold = _threshold_in_force()
        logger.info(
            "host pool: set torch's pinned_max_round_threshold_mb to %d (it was unset), so "
            "that pinned blocks over it are held at their size, not rounded to a power of "
            "two; set it yourself (PYTORCH_ALLOC_CONF) to keep another value",
            THRESHOLD_MB,
        )
    return threshold


def empty_pinned_cache(runtime: Any) -> None:
    """Hand the free blocks of ``runtime``'s pinned allocator back to the OS."""
    own = getattr(runtime, "empty_pinned_cache", None)
    if own is not None:
        own()
    elif isinstance(runtime, types.ModuleType):
        empty = getattr(torch._C, "_accelerator_emptyHostCache", None)
        if empty is not None:
            empty()
