"""Shared fixtures: every offloader test runs on the plain host path and under strict_streams."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload.device import available_device_type
from cpu_offload.testing import SimulatedBackend, strict_streams


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = available_device_type() == "cuda"
    has_npu = available_device_type() == "npu"
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))


@pytest.fixture(params=["host", "strict"], ids=["host", "strict"])
def streams(request: pytest.FixtureRequest):
    """``None`` on the plain host path; the simulator under ``strict_streams()``."""
    if request.param == "host":
        yield None
        return
    with strict_streams() as sim:
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
