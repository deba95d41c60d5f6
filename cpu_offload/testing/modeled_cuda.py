"""``torch.cuda`` for unmodified programs, on the modeled accelerator.

NOTE [Modeled cuda]
    Inside :func:`modeled_cuda` (entered within ``timed_runtime``, shapes only), a program
    that was written for a GPU runs as it is: ``torch.cuda.Stream``, ``Event``,
    ``stream()``, ``current_stream``, ``default_stream``, ``synchronize``,
    ``is_available`` and CUDA graphs (``CUDAGraph``, ``graph``, ``graph_pool_handle``,
    ``is_current_stream_capturing``, with torch's own ``make_graphed_callables`` on
    them: NOTE [Modeled CUDA graphs]) are the
    :class:`~cpu_offload.testing.TimedRuntime`'s, as are
    ``torch.accelerator.current_accelerator`` and the random-state calls that
    checkpointing makes.  Device memory is meta memory that *says* it is on ``"cuda"``:
    ``Tensor.device`` (and ``is_cuda``) of a meta tensor that is not modeled host memory
    reads ``cuda:0``, and a device ``"cuda"`` passed to a factory or to ``Tensor.to`` /
    ``Tensor.cuda`` is the meta device underneath, so ``.to("cuda", non_blocking=True)``
    of host memory is a host-to-device copy and ``empty_like(x, device="cpu",
    pin_memory=True)`` is pinned host memory, as the model counts them.

    What it is not: kernels see meta tensors (C++ code, ``tensor.device`` read inside an
    operator, still says ``meta``), there is one device, and the random state is empty.
    There are no values: a truth value read from the device (``.item()``, ``if t.all()``)
    reads True after the host waited for it, any other value raises.
    The peers' classes are imported from their installed packages and run unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .timed_device import TimedRuntime

__all__ = ["modeled_cuda"]

_CUDA = torch.device("cuda", 0)
_META = torch.device("meta")
_CPU = torch.device("cpu")


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return False


class _Operators(TorchDispatchMode):
    """A device ``"cuda"`` given to a factory is the meta device underneath; and the
    operators running are counted: torch's own Python kernels (meta kernels,
    decompositions) read ``Tensor.device`` and must see the meta device."""

    def __init__(self, runtime: TimedRuntime) -> None:
        super().__init__()
        self.runtime = runtime
        self.depth = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return self.read(args[0])
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _META}
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1

    def read(self, tensor: torch.Tensor) -> bool:
        """``.item()`` of device memory: the host waits for it, and a truth value reads
        True (shapes only, there is no value: a mask's ``.all()`` holds)."""
        runtime = self.runtime
        if runtime.timeline.capture is not None:
            runtime.timeline.capture.sync("Tensor.item()", runtime.current.clock)
        runtime.host_wait(runtime.current.clock.time, "reading a value from the device")
        if tensor.dtype != torch.bool:
            raise RuntimeError(
                f"modeled_cuda: the program reads a {tensor.dtype} value from the device; "
                "shapes only, the model has no values (only truth values read, as True)."
            )
        return True


def _moves(is_host: Callable[[torch.Tensor], bool]) -> dict[str, Any]:
    """``Tensor.to`` and ``Tensor.cuda`` with ``"cuda"`` the meta device underneath;
    moving host memory there copies (both are meta, where ``to`` would return the tensor)."""
    base_to = torch._C.TensorBase.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        moved = _is_cuda(kwargs.get("device"))
        if moved:
            kwargs["device"] = _META
        if any(_is_cuda(arg) for arg in args):
            args, moved = tuple(_META if _is_cuda(arg) else arg for arg in args), True
        if moved and is_host(self):
            kwargs["copy"] = True
        return base_to(self, *args, **kwargs)

    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False) -> torch.Tensor:
        return to(self, _CUDA, non_blocking=non_blocking)

    return {"to": to, "cuda": cuda}


def _constructors() -> dict[str, Any]:
    """``torch.tensor`` and ``torch.as_tensor`` with ``device="cuda"``: they build their
    tensor beneath the dispatch modes, so the meta device is given to them here."""
    made = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def wrap(name: str) -> Callable[..., torch.Tensor]:
        def construct(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = _META
            return made[name](data, *args, **kwargs)  # type: ignore[no-any-return]

        return construct

    return {name: wrap(name) for name in made}


class _DeviceGuard:
    """``torch.cuda.device(index)``: one device, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _runtime_functions(runtime: TimedRuntime) -> dict[str, Any]:
    """What ``torch.cuda`` becomes: the runtime's streams, events and figures."""

    def default_stream(device: Any = None) -> Any:
        return runtime.compute

    return {
        "Stream": runtime.Stream,
        "Event": runtime.Event,
        "stream": runtime.stream,
        "current_stream": runtime.current_stream,
        "default_stream": default_stream,
        "synchronize": runtime.synchronize,
        "is_available": lambda: True,
        "empty_cache": lambda: None,  # the model's allocator holds no reserve to give back
        # the pinned allocator's setting and cache are the run's, never the process's
        "exact_pinned_sizes": runtime.exact_pinned_sizes,
        "empty_pinned_cache": runtime.empty_pinned_cache,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device": _DeviceGuard,
        "get_device_name": runtime.get_device_name,
        "memory_allocated": runtime.memory_allocated,
        "max_memory_allocated": runtime.max_memory_allocated,
        "reset_peak_memory_stats": runtime.reset_peak_memory_stats,
        "get_rng_state": lambda device="cuda": torch.empty(0, dtype=torch.uint8),
        "set_rng_state": lambda state, device="cuda": None,
    }


def _graphs(runtime: TimedRuntime) -> dict[str, Any]:
    """CUDA graphs (NOTE [Modeled CUDA graphs]): the runtime's ``CUDAGraph`` and pools
    under torch's own ``graph`` and ``make_graphed_callables``, which run unchanged (a
    ``graph`` of this run's, whose default capture stream is one of the run's streams)."""
    return {
        "CUDAGraph": runtime.CUDAGraph,
        "graph": type("graph", (torch.cuda.graphs.graph,), {"default_capture_stream": None}),
        "graph_pool_handle": runtime.graph_pool_handle,
        "is_current_stream_capturing": runtime.is_current_stream_capturing,
    }


@contextlib.contextmanager
def _patched(target: Any, values: dict[str, Any]) -> Iterator[None]:
    missing = object()
    saved = {name: target.__dict__.get(name, missing) for name in values}
    try:
        for name, value in values.items():
            setattr(target, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(target, name)
            else:
                setattr(target, name, value)


@contextlib.contextmanager
def modeled_cuda(runtime: TimedRuntime) -> Iterator[None]:
    """Inside the block, ``torch.cuda`` and device ``"cuda"`` are ``runtime``'s (NOTE
    [Modeled cuda]); ``runtime`` is a shapes-only :class:`TimedRuntime` (the ``live``
    runtime of ``timed_runtime``'s report).

    Example:
        >>> import torch
        >>> from cpu_offload.testing import timed_runtime
        >>> from cpu_offload.testing.modeled_cuda import modeled_cuda
        >>> x = torch.empty(1024, 1024, device="meta")
        >>> with timed_runtime("h100") as run, modeled_cuda(run.live):
        ...     side = torch.cuda.Stream()
        ...     side.wait_stream(torch.cuda.default_stream())
        ...     with torch.cuda.stream(side):
        ...         host = torch.empty_like(x, device="cpu", pin_memory=True)
        ...         _ = host.copy_(x, non_blocking=True)
        ...     back = host.to("cuda", non_blocking=True)
        ...     where = (x.device.type, host.device.type, back.device.type)
        >>> where, run.d2h_bytes == run.h2d_bytes == 4 * 2**20
        (('cuda', 'cpu', 'cuda'), True)
    """
    if runtime.strict is not None:
        raise ValueError(
            "modeled_cuda: the runtime computes data (timed_runtime(data=True)); the modeled "
            "cuda runs shapes only: use timed_runtime(data=False)."
        )
    memory = runtime.memory
    base_device = torch._C.TensorBase.device.__get__  # type: ignore[attr-defined]

    operators = _Operators(runtime)

    def device(tensor: torch.Tensor) -> torch.device:
        real = base_device(tensor)
        if real.type != "meta" or operators.depth:
            return real
        return _CPU if is_host(tensor) else _CUDA

    def is_host(tensor: torch.Tensor) -> bool:
        block = memory.block(tensor)
        return block is not None and block.host

    def is_cuda(tensor: torch.Tensor) -> bool:
        return device(tensor).type == "cuda"

    cuda = _runtime_functions(runtime)
    accelerator = {
        "current_accelerator": lambda check_available=False: _CUDA,
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device_index": lambda: 0,
        "synchronize": runtime.synchronize,
    }
    tensor = {"device": property(device), "is_cuda": property(is_cuda), **_moves(is_host)}
    graphs = _graphs(runtime)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(torch.cuda, {**cuda, **graphs}))
        stack.enter_context(_patched(torch.cuda.graphs, graphs))
        stack.enter_context(_patched(torch._C, {"_host_emptyCache": runtime.empty_pinned_cache}))
        stack.enter_context(_patched(torch.accelerator, accelerator))
        stack.enter_context(_patched(torch.Tensor, tensor))
        stack.enter_context(_patched(torch, _constructors()))
        stack.enter_context(operators)
        yield
