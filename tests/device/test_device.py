"""StreamBackend's calls into a runtime module: a recording stand-in, the simulated runtime."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload import DefaultOffloadSynchronizer
from cpu_offload.device import backend as backend_module
from cpu_offload.device import runtime as device_module
from cpu_offload.device.runtime import StreamBackend, distributed_setup
from cpu_offload.testing import StreamHazardError, strict_runtime


class RecordingRuntime:
    """The parts of ``torch.cuda`` that sync counting and device setup use."""

    def __init__(self, mode: int = 0) -> None:
        self.mode = mode
        self.modes_set: list[object] = []
        self.devices_set: list[torch.device] = []

        self.current = 0
        self.streams_on: list[torch.device] = []

    def current_device(self) -> int:
        return self.current

    def is_available(self) -> bool:
        return True

    def Stream(self, device: torch.device) -> object:  # noqa: N802
        self.streams_on.append(device)
        return object()

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


class NoticingRuntime(RecordingRuntime):
    """torch 2.11's CUDA: setting the sync debug mode warns that it is a prototype."""

    def set_sync_debug_mode(self, mode: object) -> None:
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all "
            "synchronizing operations",
            UserWarning,
            stacklevel=2,
        )
        super().set_sync_debug_mode(mode)


def test_the_sync_debug_modes_own_notice_is_not_a_host_sync():
    runtime = NoticingRuntime()
    backend = StreamBackend(torch.device("cuda", 0), runtime)
    with backend.count_host_syncs() as syncs:
        pass
    assert syncs == [0] and backend.sync_sites == []
    with backend.count_host_syncs() as syncs:
        runtime.synchronize()  # the call counted, and where it was made
    assert syncs == [1] and backend.sync_sites == [f"{__file__}:{_line_of_sync()}"]


def _line_of_sync() -> int:
    import inspect

    lines, start = inspect.getsourcelines(test_the_sync_debug_modes_own_notice_is_not_a_host_sync)
    return start + next(i for i, line in enumerate(lines) if "runtime.synchronize()" in line)


def test_host_syncs_are_not_measurable_on_npu():
    runtime = RecordingRuntime()
    # torch.device("npu") exists only once torch_npu is imported: name the runtime.
    backend = StreamBackend(torch.device("cuda", 0), runtime, runtime_type="npu")
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


def test_a_backend_built_before_set_device_follows_the_current_device(monkeypatch):
    """A context built before ``set_device(local_rank)`` offloads on the local device."""
    runtime = RecordingRuntime()
    monkeypatch.setattr(device_module, "_runtime_module", lambda name: runtime)
    synchronizer = DefaultOffloadSynchronizer(4, 2, device="cuda")  # device 0 is current
    runtime.current = 1  # torch.cuda.set_device(1)
    synchronizer.offload_stream  # noqa: B018 - created at first use
    assert synchronizer.backend.device == torch.device("cuda", 1)
    assert runtime.streams_on == [torch.device("cuda", 1)]
    runtime.current = 0  # bound once: a later device change does not move it
    assert synchronizer.backend.device == torch.device("cuda", 1)


def test_an_indexed_device_is_kept():
    runtime = RecordingRuntime()
    runtime.current = 1
    assert StreamBackend(torch.device("cuda", 0), runtime).device == torch.device("cuda", 0)


def test_npu_copies_permuted_tensors_as_contiguous_blocks():
    """torch_npu synchronises non-contiguous host<->device copies: copy the dense blocks."""
    src = torch.randn(6, 4, 5).permute(2, 0, 1)
    with strict_runtime("npu") as runtime:
        stream = runtime.Stream()
        dst = torch.empty_strided(src.shape, src.stride())
        runtime.backend().copy(dst, src, stream)  # the flat copy: no hazard
        runtime.synchronize()
        assert torch.equal(dst, src) and dst.stride() == src.stride()
        cuda_like = StreamBackend(torch.device("cpu"), runtime, pin_memory=False)
        with pytest.raises(StreamHazardError, match="non-contiguous tensors through pageable"):
            cuda_like.copy(torch.empty_strided(src.shape, src.stride()), src, stream)


@pytest.mark.parametrize(
    "src",
    [torch.randn(6, 4)[:, :2], torch.randn(6, 4).t()],
    ids=["with gaps", "other strides"],
)
def test_pairs_that_cannot_be_copied_flat_are_left_alone(src):
    dst = torch.empty(src.shape)  # contiguous: the strides differ from src's
    assert device_module._as_contiguous_pair(dst, src) == (dst, src)


def test_npu_without_torch_npu_says_how_to_install_it():
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    for device in ("npu", "npu:1"):
        with pytest.raises(RuntimeError) as raised:
            device_module.check_device(device)
        assert str(raised.value) == (
            "cpu_offload: device 'npu' needs the torch_npu package and Ascend CANN; install "
            "them (pip install 'cpu-offload[npu]') or choose another device."
        )
    with pytest.raises(ValueError, match="device='tpu' is not a device this offloader can use"):
        device_module.check_device("tpu")  # another unknown type stays a ValueError


def test_host_memory_available_reads_meminfo_then_asks_the_system(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234567 kB\n")
    assert backend_module.host_memory_available(str(meminfo)) == 1234567 * 1024
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(backend_module.os, "sysconf", lambda name: pages[name])
    meminfo.write_text("MemTotal:       16000000 kB\n")  # an older kernel: no MemAvailable
    assert backend_module.host_memory_available(str(meminfo)) == 4096 * 1000
    assert backend_module.host_memory_available(str(tmp_path / "missing")) == 4096 * 1000

    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(backend_module.os, "sysconf", unknown)
    assert backend_module.host_memory_available(str(tmp_path / "missing")) is None


def test_memory_available_per_backend():
    available = device_module.get_backend("cpu").memory_available()
    assert available is None or available > 0  # the host's, where the system says it
    runtime = RecordingRuntime()
    backend = StreamBackend(torch.device("cuda", 0), runtime)
    assert backend.memory_available() is None  # a runtime without mem_get_info
    runtime.mem_get_info = lambda device: (7 * 2**30, 80 * 2**30)  # type: ignore[attr-defined]
    assert backend.memory_available() == 7 * 2**30


def test_a_device_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="device must be a string such as 'cuda' or 'cuda:1', or a"):
        device_module.check_device(0)  # type: ignore[arg-type]


def test_a_device_the_runtime_does_not_have_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(RuntimeError, match="device cuda was requested but torch.cuda reports no"):
        device_module.get_backend("cuda")
