"""Host memory of a node: what the ranks of one node hold in host memory, together.

NOTE [Host memory per node]
    Every rank of a node offloads into the same host memory.  A rank's need for a step
    is what it moves per step (with the default schedule every offloaded layer's copy is
    on the host at the end of the forward), with the pool's reserve
    (:func:`~cpu_offload.engine.host_buffers.pool_reserve`: its size classes waste at most
    1/16).  A node's need is that times its ranks.  With ``--host-memory G`` (the host
    memory the node gives offloading, GiB or a string with its unit) each rank's cap is
    ``G / ranks``: the policy search then takes only policies that fit it (NOTE [Plans
    under a host cap] in policy_search.py), so a small node pushes the policy towards
    checkpointing.  In a run, ``max_host_bytes="auto"`` is the same share, read from
    the machine (``host_cap.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..engine.host_buffers import pool_reserve
from ..policy.memory_budget import parse_memory_budget

__all__ = ["Node", "host_memory_argument"]

GIB = 2**30


def host_memory_argument(text: str) -> int:
    """An argparse type: GiB as a bare number, or a string with its unit (``"256GiB"``,
    ``"1TiB"``), in bytes."""
    try:
        value = float(text)
    except ValueError:
        try:
            value = int(parse_memory_budget(text, "--host-memory"))
        except ValueError:
            value = -1
        else:
            return int(value)
    else:
        value = value * GIB
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected GiB of host memory per node (a number > 0) or a string with "
            "its unit, such as 256GiB or 1TiB"
        )
    return int(value)


@dataclass(frozen=True)
class Node:
    """The ranks of a node and the host memory they share.

    Attributes:
        ranks: ranks on the node (``--ranks-per-node``).
        host_memory: bytes of host memory the node gives offloading, or None (unknown:
            nothing is capped).
    """

    ranks: int = 1
    host_memory: int | None = None

    @property
    def cap_per_rank(self) -> int | None:
        """Each rank's share of the node's host memory (its ``max_host_bytes``)."""
        return None if self.host_memory is None else self.host_memory // self.ranks

    def per_rank(self, offloaded_bytes: int) -> int:
        """Host bytes one rank holds for a step that moves ``offloaded_bytes``."""
        return int(pool_reserve(offloaded_bytes))

    def per_node(self, offloaded_bytes: int) -> int:
        return self.ranks * self.per_rank(offloaded_bytes)

    def fits(self, offloaded_bytes: int) -> bool | None:
        """Whether every rank's share holds it (None: no host memory given)."""
        cap = self.cap_per_rank
        return None if cap is None else self.per_rank(offloaded_bytes) <= cap

    def to_json(self, offloaded_bytes: int) -> dict[str, object]:
        """``host_bytes_per_rank``, ``host_bytes_per_node``, ``host_fits``."""
        return {
            "host_bytes_per_rank": self.per_rank(offloaded_bytes),
            "host_bytes_per_node": self.per_node(offloaded_bytes),
            "host_fits": self.fits(offloaded_bytes),
        }

    def describe(self, offloaded_bytes: int) -> str:
        """One line: the host memory per rank and per node, against the node's."""
        per_node = self.per_node(offloaded_bytes)
        line = (
            f"host memory: {self.per_rank(offloaded_bytes) / GIB:.3f} GiB per rank x "
            f"{self.ranks} ranks = {per_node / GIB:.3f} GiB per node"
        )
        if self.host_memory is None:
            return line + " (give --host-memory to check it against the node's)"
        verdict = "fits" if self.fits(offloaded_bytes) else "DOES NOT FIT"
        return f"{line}, of {self.host_memory / GIB:.1f} GiB: {verdict}"
