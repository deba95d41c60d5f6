"""The host cap of a rank: ``max_host_bytes=`` as bytes, a size string, or ``"auto"``.

NOTE [Host cap of a rank]
    Every rank of a node shares the node's host memory, and pinned memory cannot be
    swapped out, so a rank should not lock more than its share.  ``"auto"`` is that
    share, read when the offloader is made:

    * the node's available memory: ``MemAvailable`` of ``/proc/meminfo``, or what the
      process's cgroup still allows (``memory.max - memory.current`` in cgroup v2,
      ``memory.limit_in_bytes - memory.usage_in_bytes`` in v1) where that is lower;
    * times :data:`AUTO_HOST_FRACTION` (0.8): the rest stays for the data loaders, the
      checkpoint writer and the page cache;
    * divided by the ranks on the node: ``LOCAL_WORLD_SIZE`` as torchrun sets it (1
      without it; a value that is no whole number >= 1 is refused, naming it).

    Any other value means what it means for ``memory_budget=``: bytes as an int, or a
    string with its unit (``"64GiB"``), parsed by :mod:`cpu_offload.device.amounts`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .amounts import AUTO, FORMS, parse_bytes
from .backend import host_memory_available

__all__ = [
    "AUTO_HOST_FRACTION",
    "auto_host_cap",
    "cgroup_memory_available",
    "host_cap_bytes",
    "local_world_size",
]

#: the fraction of the node's available host memory that ``"auto"`` shares among its ranks
AUTO_HOST_FRACTION = 0.8

_CGROUP_FILES = (
    ("memory.max", "memory.current"),  # v2
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_memory_available(root: str = "/sys/fs/cgroup") -> int | None:
    """What the process's memory cgroup still allows (limit less usage), or ``None``
    without a limit (no cgroup, or ``max``)."""
    for limit_file, usage_file in _CGROUP_FILES:
        limit = _read_int(os.path.join(root, limit_file))
        if limit is None or limit >= 2**60:  # v1 says "no limit" with a huge number
            continue
        usage = _read_int(os.path.join(root, usage_file)) or 0
        return max(0, limit - usage)
    return None


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1.

    Raises:
        ValueError: ``LOCAL_WORLD_SIZE`` is set but is no whole number >= 1 (``"0"``,
            ``"-1"``, ``"abc"``): read as one rank, each rank would take the node's share.
    """
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE")
    if text is None or not text.strip():
        return 1
    try:
        ranks = int(text)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(
            f"cpu_offload: max_host_bytes='auto' shares the node's host memory among its "
            f"ranks, which it reads from LOCAL_WORLD_SIZE; expected a whole number >= 1 (as "
            f"torchrun sets it), found LOCAL_WORLD_SIZE={text!r}. Set it to the ranks on "
            "this node (or unset it for one), or give max_host_bytes as bytes or a string "
            "such as '8GiB'."
        )
    return ranks


def auto_host_cap(
    meminfo: str = "/proc/meminfo",
    cgroup_root: str = "/sys/fs/cgroup",
    environ: Mapping[str, str] | None = None,
) -> int:
    """The bytes ``max_host_bytes="auto"`` stands for now (NOTE [Host cap of a rank])."""
    available = [
        n
        for n in (host_memory_available(meminfo), cgroup_memory_available(cgroup_root))
        if n is not None
    ]
    if not available:
        raise ValueError(
            "cpu_offload: max_host_bytes='auto' cannot read the host's available memory "
            "(no /proc/meminfo, no cgroup limit); give the cap as bytes or a string such as "
            "'64GiB'."
        )
    return int(min(available) * AUTO_HOST_FRACTION) // local_world_size(environ)


def host_cap_bytes(value: object, api: str = "cpu_offload") -> int | None:
    """``max_host_bytes=`` as a number of bytes, or None (no cap).

    Args:
        value: None, ``"auto"`` (NOTE [Host cap of a rank]), or an amount of memory as
            ``memory_budget=`` takes it (bytes, or a string such as ``"64GiB"``).
        api: the function's name, for messages.

    Example:
        >>> host_cap_bytes("64GiB"), host_cap_bytes(None)
        (68719476736, None)
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return auto_host_cap()
    return parse_bytes(
        value,
        "max_host_bytes",
        api,
        forms=f"{FORMS}, 'auto' (the node's available host memory shared by its ranks), "
        "or None (no cap)",
    )
