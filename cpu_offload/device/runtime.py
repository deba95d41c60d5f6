"""The one module that talks to accelerator runtimes.

Everything else in cpu_offload asks a :class:`~cpu_offload.device.backend.DeviceBackend` for
streams, events, copies and host buffers, and never names ``torch.cuda``, ``torch.npu``
or ``torch.xpu`` itself.  Accelerators that follow the CUDA-style stream/event API
(CUDA, Ascend NPU through ``torch_npu``, Intel XPU) share one implementation,
:class:`StreamBackend`; a machine without one gets ``backend.HostBackend``, whose
copies are synchronous.  ``cpu_offload.testing.strict_streams`` installs a
simulated backend through :func:`override_host_backend`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import platform
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .backend import DeviceBackend, Event, HostBackend, Stream, TimingEvent, is_dense
from .pinned_sizes import empty_pinned_cache, exact_pinned_sizes

__all__ = [
    "StreamBackend",
    "available_device_type",
    "check_device",
    "deterministic_algorithms",
    "device_name",
    "distributed_setup",
    "get_backend",
    "graph_runtime",
    "override_host_backend",
    "pinned_memory_stats",
    "supports_fp8_matmul",
]

# Accelerators with a CUDA-like runtime module: torch.<name>.Stream, .Event, ...
_STREAM_DEVICE_TYPES = ("cuda", "npu", "xpu")
# Whether the runtime's sync debug mode warns through Python's warnings (torch_npu
# logs them in C++ only).
_SYNC_WARNINGS_IN_PYTHON = {"cuda": True, "npu": False, "xpu": True}
# What the sync debug mode's warning says ("called a synchronizing CUDA operation"); not
# its notice that the mode "does not yet detect all synchronizing operations".
_SYNC_WARNING = "called a synchronizing"
# Runtimes whose host<->device copies stay asynchronous only between contiguous tensors.
_CONTIGUOUS_COPIES_ONLY = {"npu"}


class StreamBackend(DeviceBackend):
    """An accelerator with a CUDA-style runtime module (``torch.cuda``, ``torch.npu``, ...).

    Args:
        device: the device whose tensors are offloaded.  Without an index the
            backend binds, when first used, to the runtime's current device then:
            a context built before ``set_device(local_rank)`` offloads on the local
            device, not on device 0.
        runtime: the runtime module, ``torch.cuda`` or ``torch.npu`` (or the
            simulated one of :mod:`cpu_offload.testing`).
        runtime_type: which runtime's behaviour to expect (``"cuda"``, ``"npu"``,
            ``"xpu"``); the device's type by default.
        pin_memory: page-lock host buffers.
    """

    def __init__(
        self,
        device: torch.device,
        runtime: Any,
        *,
        runtime_type: str | None = None,
        pin_memory: bool = True,
    ) -> None:
        self._requested = device
        self._device: torch.device | None = device if device.index is not None else None
        self._runtime = runtime
        self.runtime_type = runtime_type or device.type
        self.pin_memory = pin_memory
        #: where the synchronising calls of the last :meth:`count_host_syncs` came from
        self.sync_sites: list[str] = []
        # torch_npu keeps a host<->device copy asynchronous only when both sides are
        # contiguous; otherwise it stages through pageable memory and synchronises.
        self._contiguous_copies_only = self.runtime_type in _CONTIGUOUS_COPIES_ONLY
        # CUDA's raw current stream (an int) costs less than a Stream object.
        self._raw_stream = getattr(torch._C, f"_{device.type}_getCurrentRawStream", None)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        device = self._device
        if device is None:
            if self._requested.type == "cpu":
                device = torch.device("cpu")
            else:
                device = torch.device(self._requested.type, self._runtime.current_device())
            self._device = device
        return device

    @property
    def device_type(self) -> str:
        return self._requested.type

    def new_stream(self) -> Stream:
        return self._runtime.Stream(device=self.device)

    def current_stream(self) -> Stream:
        return self._runtime.current_stream(self.device)

    def new_event(self) -> Event:
        return self._runtime.Event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream, label: str = "") -> None:
        self.copy_many([dst], [src], stream, label)

    def copy_many(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Stream, label: str = ""
    ) -> None:
        if self._contiguous_copies_only:
            pairs = [_as_contiguous_pair(dst, src) for dst, src in zip(dsts, srcs)]
        else:
            pairs = list(zip(dsts, srcs))
        with self._runtime.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if isinstance(stream, torch.Stream):  # a simulated runtime's streams are not
            tensor.record_stream(stream)

    def is_capturing(self) -> bool:
        capturing = getattr(self._runtime, "is_current_stream_capturing", None)
        return capturing is not None and bool(capturing())

    def current_stream_key(self) -> object:
        if self._raw_stream is not None:
            return self._raw_stream(self.device.index)
        stream = self._runtime.current_stream(self.device)
        return getattr(stream, "stream_id", stream)

    def synchronize(self) -> None:
        self._runtime.synchronize(self.device)

    def host_round_threshold(self) -> int | None:
        return exact_pinned_sizes(self._runtime) if self.pin_memory else 0

    def empty_host_cache(self) -> None:
        if self.pin_memory:
            empty_pinned_cache(self._runtime)

    def timing_event(self) -> TimingEvent:
        return self._runtime.Event(enable_timing=True)

    @contextlib.contextmanager
    def count_host_syncs(self) -> Iterator[list[int] | None]:
        """Counts the synchronising calls the runtime's sync debug mode reports.

        ``None`` where they cannot be counted: torch_npu writes its sync warnings to
        the CANN log, never to Python.  CUDA's counter sees synchronising copies,
        ``synchronize`` and ``.item()``-like calls, but not ``cudaHostAlloc`` (a
        pinned allocation) nor event waits.  The caller's mode is restored after, and
        :attr:`sync_sites` holds where each counted call came from (``file:line`` of
        the Python frame that made it).
        """
        set_mode = getattr(self._runtime, "set_sync_debug_mode", None)
        get_mode = getattr(self._runtime, "get_sync_debug_mode", None)
        if (
            set_mode is None
            or get_mode is None
            or not _SYNC_WARNINGS_IN_PYTHON.get(self.runtime_type, False)
        ):
            yield None
            return
        previous = get_mode()
        count = [0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_mode("warn")
            try:
                yield count
            finally:
                set_mode(previous)
                found = [w for w in caught if _SYNC_WARNING in str(w.message)]
                count[0] = len(found)
                self.sync_sites = [f"{w.filename}:{w.lineno}" for w in found]

    def memory_allocated(self) -> int | None:
        return int(self._runtime.memory_allocated(self.device))

    def max_memory_allocated(self) -> int | None:
        return int(self._runtime.max_memory_allocated(self.device))

    def reset_peak_memory_stats(self) -> None:
        self._runtime.reset_peak_memory_stats(self.device)

    def memory_available(self) -> int | None:
        mem_get_info = getattr(self._runtime, "mem_get_info", None)
        return None if mem_get_info is None else int(mem_get_info(self.device)[0])

    def memory_reserved(self) -> int | None:
        memory_reserved = getattr(self._runtime, "memory_reserved", None)
        return None if memory_reserved is None else int(memory_reserved(self.device))


def _as_contiguous_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` as contiguous 1-D views of the same memory, where they can be.

    Two dense tensors with the same strides (a permuted tensor and its host copy)
    lay out their elements identically, so copying the memory blocks they fill
    copies each element to its place; nothing is allocated and no compute runs.
    Other pairs are returned as they are.
    """
    if src.is_contiguous() and dst.is_contiguous():
        return dst, src
    if dst.stride() != src.stride() or dst.shape != src.shape or not is_dense(src):
        return dst, src
    numel = src.numel()
    return (
        dst.as_strided((numel,), (1,), dst.storage_offset()),
        src.as_strided((numel,), (1,), src.storage_offset()),
    )


_host_backend_factory: contextvars.ContextVar[Callable[[], DeviceBackend] | None] = (
    contextvars.ContextVar("cpu_offload_host_backend_factory", default=None)
)


@contextlib.contextmanager
def override_host_backend(factory: Callable[[], DeviceBackend]) -> Iterator[None]:
    """Within the block, ``get_backend("cpu")`` returns ``factory()`` (used by testing)."""
    token = _host_backend_factory.set(factory)
    try:
        yield
    finally:
        _host_backend_factory.reset(token)


def _runtime_module(device_type: str) -> Any:
    if device_type == "npu" and "torch_npu" not in sys.modules:
        try:
            importlib.import_module("torch_npu")
        except ImportError as error:
            raise RuntimeError(
                "cpu_offload: device 'npu' needs the torch_npu package and Ascend CANN; "
                "install them (pip install 'cpu-offload[npu]') or choose another device."
            ) from error
    return getattr(torch, device_type)


def graph_runtime(device_type: str) -> Any:
    """``torch.<device_type>`` where it captures and replays graphs (``CUDAGraph``,
    ``graph``, ``Stream``, ``synchronize``; the modeled one under ``modeled_cuda``), for a
    check that captures a step; ``None`` where it does not."""
    runtime = getattr(torch, device_type, None)
    return runtime if hasattr(runtime, "CUDAGraph") and hasattr(runtime, "graph") else None


def pinned_memory_stats(device_type: str) -> dict[str, int] | None:
    """torch's pinned (host) allocator statistics for ``device_type``'s runtime
    (``host_memory_stats()``: ``allocated_bytes.current``, ``num_host_alloc``, ...), or
    ``None`` where the runtime reports none."""
    runtime = getattr(torch, device_type, None)
    stats = getattr(runtime, "host_memory_stats", None)
    return None if stats is None else dict(stats())


def available_device_type() -> str:
    """The best accelerator type PyTorch can use here, or ``"cpu"``.

    ``torch_npu`` is never imported here: an NPU is found only when the user has
    imported it already.
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and current.type in _STREAM_DEVICE_TYPES:
            return current.type
    for device_type in _STREAM_DEVICE_TYPES:
        if device_type == "npu" and "torch_npu" not in sys.modules:
            continue
        runtime = getattr(torch, device_type, None)
        if runtime is not None and runtime.is_available():
            return device_type
    return "cpu"


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` of a type this package can use.

    Raises:
        ValueError: not a device string, or a device type without streams here.
        TypeError: neither a string nor a ``torch.device``.
        RuntimeError: ``npu`` without torch_npu installed (the message says how to install it).
    """
    allowed = ", ".join(repr(t) for t in ("cpu",) + _STREAM_DEVICE_TYPES)
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"cpu_offload: device must be a string such as 'cuda' or 'cuda:1', or a "
            f"torch.device; got {type(device).__name__} {device!r}."
        )
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
        if str(device).split(":")[0] == "npu":  # torch knows 'npu' once torch_npu is imported
            _runtime_module("npu")  # says torch_npu is missing, and how to install it
            parsed = torch.device(device)
    if parsed is None or parsed.type not in ("cpu",) + _STREAM_DEVICE_TYPES:
        raise ValueError(
            f"cpu_offload: device={str(device)!r} is not a device this offloader can use: "
            f"expected one of {allowed}, optionally with an index ('cuda:1'). The best "
            f"available here is {available_device_type()!r}."
        )
    return parsed


def get_backend(device: torch.device | str | None = None) -> DeviceBackend:
    """The backend for ``device``; ``None`` picks the best available device."""
    device = torch.device(available_device_type()) if device is None else check_device(device)
    if device.type == "cpu":
        factory = _host_backend_factory.get()
        return factory() if factory is not None else HostBackend()
    runtime = _runtime_module(device.type)
    if not runtime.is_available():
        raise RuntimeError(
            f"cpu_offload: device {device} was requested but torch.{device.type} "
            "reports no available device."
        )
    return StreamBackend(device, runtime)


#: torch.distributed backend of each device type's collectives.
_COLLECTIVES = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def distributed_setup(local_rank: int) -> tuple[str, torch.device]:
    """The process group backend and the device of ``local_rank`` on this machine.

    ``("nccl", cuda:LOCAL_RANK)`` on GPUs, ``("hccl", npu:LOCAL_RANK)`` on Ascend NPUs,
    ``("gloo", cpu)`` without an accelerator; the device is made the current one.
    """
    device_type = available_device_type()
    if device_type == "cpu":
        return "gloo", torch.device("cpu")
    device = torch.device(device_type, local_rank)
    _runtime_module(device_type).set_device(device)
    return _COLLECTIVES[device_type], device


def device_name(device: torch.device) -> str:
    """The product name of ``device`` (the processor for the CPU)."""
    if device.type == "cpu":
        return platform.processor() or platform.machine()
    return str(_runtime_module(device.type).get_device_name(device))


def supports_fp8_matmul(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 matmuls on ``device`` (CUDA, compute 8.9+)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels inside the block (``torch.use_deterministic_algorithms``), so
    that two runs of one program compare bit for bit; on CUDA, cuBLAS is given the
    workspace setting it needs for that (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS
    first runs: enter the block before the process's first matrix product).  An
    operator without a deterministic kernel raises ``RuntimeError`` inside it."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn_only)
        if config is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
