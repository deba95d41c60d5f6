"""A simulated ``torch.cuda`` / ``torch.npu`` for running StreamBackend without a device.

NOTE [Simulated runtime]
    :class:`~cpu_offload.device.runtime.StreamBackend` is the code that runs on GPUs and
    NPUs.  :class:`SimulatedRuntime` gives it the slice of the runtime module it
    calls (``Stream``, ``Event``, ``current_stream``, ``stream``, ``synchronize``,
    ``current_device``, memory statistics, the sync debug mode), built on the strict
    stream simulator: a copy issued inside ``runtime.stream(side)`` is queued on
    that side stream, and every hazard of NOTE [Strict stream simulation] still
    raises.  "Device" tensors are CPU tensors.

    The ``"cuda"`` flavour reports synchronisations through Python warnings under
    ``set_sync_debug_mode("warn")``, as CUDA does; the ``"npu"`` flavour does not (the
    sync warnings of torch_npu go to the CANN log), and treats a side-stream copy
    between non-contiguous tensors as a hazard, since torch_npu stages such a copy
    through pageable memory and synchronises the host.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..device.backend import HostTimingEvent
from ..device.runtime import StreamBackend, override_host_backend
from .simulator import ComputeWatch, SimulatedBackend, SimulatedEvent, SimulatedStream

__all__ = ["FLAVOURS", "SimulatedRuntime", "SyncDebugMode", "strict_runtime"]

#: runtimes the simulation can behave like
FLAVOURS = ("cuda", "npu")
_SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}


class SimulatedTimingEvent(SimulatedEvent):
    """An event that also measures wall-clock time, for ``Event(enable_timing=True)``."""

    def __init__(self, sim: SimulatedBackend) -> None:
        super().__init__(sim)
        self.time: float | None = None

    def record(self, stream: SimulatedStream | None = None) -> None:
        super().record(stream)
        self.time = time.perf_counter()

    elapsed_time = HostTimingEvent.elapsed_time  # milliseconds from this event to ``end``


class SyncDebugMode:
    """``torch.cuda``'s sync debug mode, for a modeled runtime of a ``flavour``: a
    synchronizing operation warns or raises as CUDA does (NOTE [Simulated runtime])."""

    flavour: str
    _sync_debug_mode = 0
    #: the frames between the user's call and :meth:`_on_sync`'s warning
    sync_warning_stacklevel = 3

    def set_sync_debug_mode(self, mode: int | str) -> None:
        self._sync_debug_mode = _SYNC_DEBUG_MODES[mode] if isinstance(mode, str) else mode

    def get_sync_debug_mode(self) -> int:
        return self._sync_debug_mode

    def _on_sync(self, what: str) -> None:
        if self.flavour != "cuda" or self._sync_debug_mode == 0:
            return  # torch_npu reports synchronisations to its C++ log only
        message = f"called a synchronizing CUDA operation ({what})"
        if self._sync_debug_mode == 2:
            raise RuntimeError(message)
        warnings.warn(message, UserWarning, stacklevel=self.sync_warning_stacklevel)


class SimulatedRuntime(SyncDebugMode):
    """The parts of ``torch.cuda`` (or ``torch.npu``) that StreamBackend uses.

    Args:
        flavour: ``"cuda"`` or ``"npu"``; see NOTE [Simulated runtime].
        sim: the simulator to build on; a new one by default.
    """

    def __init__(self, flavour: str = "cuda", sim: SimulatedBackend | None = None) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(
                f"SimulatedRuntime: flavour must be one of {FLAVOURS}, got {flavour!r}."
            )
        self.flavour = flavour
        self.sim = sim if sim is not None else SimulatedBackend()
        self.sim.contiguous_copies_only = flavour == "npu"

    # -- streams and events
    def Stream(self, device: Any = None, priority: int = 0) -> SimulatedStream:  # noqa: N802
        return self.sim.new_stream()

    def Event(self, enable_timing: bool = False) -> SimulatedEvent:  # noqa: N802
        return SimulatedTimingEvent(self.sim) if enable_timing else SimulatedEvent(self.sim)

    def current_stream(self, device: Any = None) -> SimulatedStream:
        return self.sim.current

    @contextlib.contextmanager
    def stream(self, stream: SimulatedStream | None) -> Iterator[None]:
        """Make ``stream`` current inside the block, as ``torch.cuda.stream`` does."""
        previous = self.sim.current
        if stream is not None:
            self.sim.current = stream
        try:
            yield
        finally:
            self.sim.current = previous

    def synchronize(self, device: Any = None) -> None:
        self._on_sync("torch.cuda.synchronize")
        self.sim.synchronize()

    # -- the device
    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device: Any = None) -> str:
        return f"simulated {self.flavour}"

    # -- memory statistics: the simulator keeps none
    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def backend(self) -> StreamBackend:
        """A :class:`StreamBackend` on this runtime, offloading CPU tensors."""
        return StreamBackend(torch.device("cpu"), self, runtime_type=self.flavour, pin_memory=False)


@contextlib.contextmanager
def strict_runtime(flavour: str = "cuda") -> Iterator[SimulatedRuntime]:
    """Offload through :class:`StreamBackend` on a :class:`SimulatedRuntime`.

    Like :func:`~cpu_offload.testing.strict_streams`, but the backend is the one that
    runs on accelerators, so its stream, event and copy calls are exercised.

    Example:
        >>> import torch
        >>> from cpu_offload import get_cpu_offload_context
        >>> from cpu_offload.testing import strict_runtime
        >>> with strict_runtime("npu") as runtime:
        ...     ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
        ...     x = torch.randn(16, 16, requires_grad=True)
        ...     for _ in range(2):
        ...         with ctx:
        ...             x = x.sin()
        ...         x = sync_fn(x)
        ...     x.sum().backward()
        >>> type(ctx.offload_synchronizer.backend).__name__, runtime.sim.counters.copies_run
        ('StreamBackend', 2)
    """
    runtime = SimulatedRuntime(flavour)
    with override_host_backend(runtime.backend), ComputeWatch(runtime.sim):
        yield runtime
        runtime.sim.synchronize()
