"""Counters of what an offloader did."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadStats"]


@dataclass
class OffloadStats:
    """Running totals kept by a synchronizer.

    Attributes:
        tensors_offloaded: device-to-host copies issued (a tensor saved twice, or views
            of one, is one copy): a step report's ``copied_tensors``, summed.
        bytes_offloaded: bytes copied device to host.
        tensors_reloaded: host-to-device copies issued.
        bytes_reloaded: bytes copied host to device.
        on_demand_reloads: layers reloaded by a pop because no reload was scheduled.
        slices_on_demand: slices of a layer reloaded in slices that a pop issued itself
            (a tensor unpacked before its slice's turn; reload_slices.py).
        forward_passes: forward passes that ran a layer with grad enabled (a no_grad
            forward, which saves nothing, is not counted).
        passes_moved_whole: forward passes moved whole to the host (``keep_passes``).
        tensors_kept_by_host_cap: tensors left on the device because the host buffer
            pool was at ``max_host_bytes`` or the host refused to give it more, and
        bytes_kept_by_host_cap: their bytes.
        host_allocations_failed: host allocations the host refused (out of memory,
            ``RLIMIT_MEMLOCK``, a cgroup's limit); the pool holds at what it had then.
    """

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    tensors_reloaded: int = 0
    bytes_reloaded: int = 0
    on_demand_reloads: int = 0
    slices_on_demand: int = 0
    forward_passes: int = 0
    passes_moved_whole: int = 0
    tensors_kept_by_host_cap: int = 0
    bytes_kept_by_host_cap: int = 0
    host_allocations_failed: int = 0

    def __str__(self) -> str:
        """One line of the copies, as the docs' examples print it: a tensor saved twice,
        or views of one, is one copy (a step report counts what moved per save)."""
        return (
            f"copied {self.tensors_offloaded} tensors ({self.bytes_offloaded / 2**20:.2f} MiB) "
            f"to the host and {self.tensors_reloaded} ({self.bytes_reloaded / 2**20:.2f} MiB) "
            f"back in {self.forward_passes} forward passes"
            + (f" ({self.passes_moved_whole} moved whole)" if self.passes_moved_whole else "")
            + (f", {self.on_demand_reloads} reloaded on demand" if self.on_demand_reloads else "")
            + (
                f", {self.tensors_kept_by_host_cap} kept on the device by max_host_bytes"
                if self.tensors_kept_by_host_cap
                else ""
            )
        )

    def count(self, direction: str, tensors: int, nbytes: int) -> None:
        """Add copies of ``direction`` ``"d2h"`` (offload) or ``"h2d"`` (reload)."""
        if direction == "d2h":
            self.tensors_offloaded += tensors
            self.bytes_offloaded += nbytes
        else:
            self.tensors_reloaded += tensors
            self.bytes_reloaded += nbytes
