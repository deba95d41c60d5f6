"""The ways of running a stack of layers that the benchmark compares."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

from ..context import get_cpu_offload_context
from ..device.backend import DeviceBackend
from ..engine.layer_context import OffloadContext
from ..report.copy_timer import CopyTimer

__all__ = ["Mode", "make_mode", "save_on_cpu"]

Boundary = Callable[[torch.Tensor], torch.Tensor]


class Mode:
    """Runs the layers one way. ``skip_reason`` is set when the mode cannot run here."""

    name = "none"
    skip_reason: str | None = None
    synchronizer: Any = None
    copy_timer: CopyTimer | None = None

    def forward(self, layers: Any, x: torch.Tensor, boundary: Boundary) -> torch.Tensor:
        with self.around_forward():
            for layer in layers:
                x = boundary(self.call(layer, x))
        return x

    def call(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def around_forward(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class OffloadMode(Mode):
    def __init__(self, k: int, layers: int, backend: DeviceBackend, min_numel: int) -> None:
        self.name = f"offload:{k}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # k = layers - 1 is measured on purpose
            self.context, self.sync_fn = get_cpu_offload_context(
                True, k, layers, device=backend.device, min_offload_numel=min_numel
            )
        self.synchronizer = cast(OffloadContext, self.context).offload_synchronizer
        self.copy_timer = self.synchronizer.copy_timer = CopyTimer(backend)

    def call(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        with self.context:
            x = layer(x)
        return self.sync_fn(x)


class SaveOnCpuMode(Mode):
    name = "save_on_cpu"

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend

    def around_forward(self) -> contextlib.AbstractContextManager[Any]:
        return save_on_cpu(self.backend)


def save_on_cpu(backend: DeviceBackend) -> contextlib.AbstractContextManager[Any]:
    """``torch.autograd.graph.save_on_cpu`` pinning for ``backend``'s device type.

    Without ``device_type`` it pins only for CUDA; it is passed where torch accepts it.
    """
    pin = backend.pin_memory
    if "device_type" in inspect.signature(torch.autograd.graph.save_on_cpu).parameters:
        return torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=backend.device_type)
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)  # pragma: no cover - older torch


class CheckpointMode(Mode):
    name = "checkpoint"

    def call(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, x, use_reentrant=False)


class TorchtuneMode(Mode):
    """A peer's ``OffloadActivations`` (torchtune's, or TRL's copy of it), unmodified."""

    name = "torchtune"
    module = "torchtune.training"
    package = "torchtune"

    def __init__(self, backend: DeviceBackend) -> None:
        if backend.device.type != "cuda":
            # OffloadActivations calls torch.cuda even with use_streams=False.
            self.skip_reason = (
                f"{self.package}'s OffloadActivations needs CUDA, not {backend.device.type}"
            )
            return
        try:
            offload = importlib.import_module(self.module).OffloadActivations
        except ImportError as error:
            self.skip_reason = (
                f"{self.package} is not importable ({error}); pip install 'cpu-offload[peers]'"
            )
            return
        self._factory = lambda: offload(use_streams=True)

    @contextlib.contextmanager
    def around_forward(self) -> Iterator[None]:
        with self._factory():
            yield


class TrlMode(TorchtuneMode):
    name = "trl"
    module = "trl.models.activation_offloading"
    package = "trl"


class HfOffloadMode(Mode):
    name = "hf_offload"
    skip_reason = (
        "hf_offload runs transformers' own Llama stack: on the modeled accelerator only so "
        "far (--simulate PROFILE)"
    )


def make_mode(name: str, layers: int, backend: DeviceBackend, min_numel: int) -> Mode:
    if name == "none":
        return Mode()
    if name.startswith("offload:"):
        return OffloadMode(int(name.split(":", 1)[1]), layers, backend, min_numel)
    if name == "save_on_cpu":
        return SaveOnCpuMode(backend)
    if name == "checkpoint":
        return CheckpointMode()
    if name == "torchtune":
        return TorchtuneMode(backend)
    if name == "trl":
        return TrlMode(backend)
    if name == "hf_offload":
        return HfOffloadMode()
    raise ValueError(
        f"cpu_offload.bench: unknown mode {name!r}; expected none, offload:K, save_on_cpu, "
        "checkpoint, torchtune, trl or hf_offload."
    )
