"""StreamBackend's calls into a runtime module, on a recording stand-in for torch.cuda/npu."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload import device as device_module
from cpu_offload.device import StreamBackend, distributed_setup


class RecordingRuntime:
    """The parts of ``torch.cuda`` that sync counting and device setup use."""

    def __init__(self, mode: int = 0) -> None:
        self.mode = mode
        self.modes_set: list[object] = []
        self.devices_set: list[torch.device] = []

    def current_device(self) -> int:
        return 0

    def get_sync_debug_mode(self) -> int:
        return self.mode

    def set_sync_debug_mode(self, mode: object) -> None:
        self.modes_set.append(mode)
        self.mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)  # type: ignore[arg-type]

    def synchronize(self, device: object = None) -> None:
        if self.mode == 1:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)

    def set_device(self, device: torch.device) -> None:
        self.devices_set.append(device)


def test_host_syncs_are_counted_and_the_callers_mode_restored():
    runtime = RecordingRuntime(mode=2)  # the caller runs with "error"
    backend = StreamBackend(torch.device("cuda", 0), runtime)
    with backend.count_host_syncs() as syncs:
        runtime.synchronize()
        runtime.synchronize()
    assert syncs == [2]
    assert runtime.modes_set == ["warn", 2] and runtime.mode == 2


class NpuFlavouredBackend(StreamBackend):
    """``torch.device("npu")`` exists only once torch_npu is imported: keep the type here."""

    device_type = "npu"  # type: ignore[assignment]


def test_host_syncs_are_not_measurable_on_npu():
    runtime = RecordingRuntime()
    backend = NpuFlavouredBackend(torch.device("cuda", 0), runtime)
    with backend.count_host_syncs() as syncs:
        runtime.synchronize()
    assert syncs is None and runtime.modes_set == []  # torch_npu logs them in C++ only


def test_distributed_setup_on_the_cpu():
    assert distributed_setup(3) == ("gloo", torch.device("cpu"))


# torch.device("npu", 1) needs torch_npu; hccl is the table's entry for "npu".
@pytest.mark.parametrize("device_type, collective", [("cuda", "nccl"), ("xpu", "xccl")])
def test_distributed_setup_picks_the_collectives_and_the_local_device(
    monkeypatch, device_type, collective
):
    runtime = RecordingRuntime()
    monkeypatch.setattr(device_module, "available_device_type", lambda: device_type)
    monkeypatch.setattr(device_module, "_runtime_module", lambda name: runtime)
    assert distributed_setup(1) == (collective, torch.device(device_type, 1))
    assert runtime.devices_set == [torch.device(device_type, 1)]
