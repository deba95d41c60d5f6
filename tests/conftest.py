"""Shared fixtures: every offloader test runs on the plain host path and under strict_streams."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload.device.runtime import available_device_type
from cpu_offload.testing import SimulatedBackend, strict_runtime, strict_streams


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device_type = available_device_type()
    has_npu = device_type == "npu"
    for item in items:
        if "gpu" in item.keywords and device_type == "cpu":
            item.add_marker(pytest.mark.skip(reason="needs an accelerator (CUDA GPU, Ascend NPU)"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))


@pytest.fixture(params=["host", "strict", "cuda-runtime", "npu-runtime"])
def streams(request: pytest.FixtureRequest):
    """How the offloader under test runs, and the simulator it runs on (if any).

    ``host``: the plain host path (``None``).  ``strict``: the simulated backend of
    ``strict_streams()``.  ``cuda-runtime``, ``npu-runtime``: ``StreamBackend``, the
    accelerator backend, on the simulated runtime of ``strict_runtime()`` in that
    flavour.  The last three yield the simulator.
    """
    if request.param == "host":
        yield None
        return
    if request.param == "strict":
        with strict_streams() as sim:
            yield sim
    else:
        with strict_runtime(request.param.split("-")[0]) as runtime:
            sim = runtime.sim
            yield sim
    assert sim.counters.hazards == 0


@pytest.fixture
def quiet():
    """Silence the expected warnings of a test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def pytest_configure(config: pytest.Config) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)


__all__ = ["SimulatedBackend"]
