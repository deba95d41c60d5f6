"""Shared fixtures: every offloader test runs on the plain host path and under strict_streams."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from cpu_offload.device.runtime import available_device_type
from cpu_offload.testing import SimulatedBackend, strict_runtime, strict_streams, timed_runtime


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device_type = available_device_type()
    has_npu = device_type == "npu"
    for item in items:
        if "gpu" in item.keywords and device_type == "cpu":
            item.add_marker(pytest.mark.skip(reason="needs an accelerator (CUDA GPU, Ascend NPU)"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch_npu"))


#: how the offloader under test runs (the ``streams`` fixture)
STREAM_FLAVOURS = ["host", "strict", "cuda-runtime", "npu-runtime"]
#: the files whose tests also run under the caching allocator's per-stream pools (the
#: ``pools`` flavour: NOTE [Allocator reuse across streams]): the parity suite (its sliced
#: and on-demand rows included), the pipeline, keep_passes, split backward, the second
#: backward through a retained graph and reloads on demand
POOLED_FILES = {
    "test_autograd_parity.py",
    "test_pipeline.py",
    "test_pass_offload.py",
    "test_split_backward.py",
    "test_retained_graph_parity.py",
    "test_on_demand_reloads.py",
}
#: rows the modeled accelerator cannot run, and why (they run in the other flavours)
NOT_POOLED = {
    "sparse": "its costs read strides, which a sparse tensor has not",
    "jagged": "its costs read strides, which a jagged tensor has not",
    "nested": "its costs read strides, which a nested tensor has not",
    "threads": "its dispatch modes are the thread's that entered it",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "streams" in metafunc.fixturenames:
        pooled = metafunc.definition.path.name in POOLED_FILES
        metafunc.parametrize(
            "streams", STREAM_FLAVOURS + (["pools"] if pooled else []), indirect=True
        )


@pytest.fixture
def streams(request: pytest.FixtureRequest):
    """How the offloader under test runs, and the simulator it runs on (if any).

    ``host``: the plain host path (``None``).  ``strict``: the simulated backend of
    ``strict_streams()``.  ``cuda-runtime``, ``npu-runtime``: ``StreamBackend``, the
    accelerator backend, on the simulated runtime of ``strict_runtime()`` in that
    flavour.  ``pools`` (the files of :data:`POOLED_FILES`): ``StreamBackend`` on the
    modeled H100 computing real data (``timed_runtime("h100", data=True)``), whose
    caching allocator gives each stream its own pool and raises ``StreamHazardError`` on
    a reuse under another stream's pending work, over the strict simulator.  The last
    four yield the simulator.
    """
    if request.param == "host":
        yield None
        return
    if request.param == "strict":
        with strict_streams() as sim:
            yield sim
    elif request.param == "pools":
        for word, why in NOT_POOLED.items():
            if word in request.node.name:
                pytest.skip(f"the modeled accelerator: {why}")
        with timed_runtime("h100", data=True) as run:
            sim = run.live.strict
            yield sim
    else:
        with strict_runtime(request.param.split("-")[0]) as runtime:
            sim = runtime.sim
            yield sim
    assert sim.counters.hazards == 0


class TickingClock:
    """``time`` as the offloader reads it in tests: every reading of a clock is one
    :attr:`TICK` after the last, so that what the offloader times (a layer's forward in
    the measured step, a timed copy) is the same on an idle machine and a loaded one.
    Everything else is the real ``time`` module."""

    TICK = 1e-3

    def __init__(self) -> None:
        self.now = 0.0

    def _tick(self) -> float:
        self.now += self.TICK
        return self.now

    perf_counter = thread_time = monotonic = process_time = _tick

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


#: the modules whose clocks decide what the offloader does (the measured step's layer
#: times, the host and the simulated runtime's timing events)
TIMED_MODULES = (
    "cpu_offload.policy.measured_step",
    "cpu_offload.device.backend",
    "cpu_offload.testing.runtime",
)


@pytest.fixture(autouse=True)
def ticking_clock(monkeypatch: pytest.MonkeyPatch) -> TickingClock:
    """No test decides from a wall clock (shared/SPEC.md): the clocks the offloader's
    decisions read tick by a fixed step per reading (:class:`TickingClock`)."""
    clock = TickingClock()
    for module in TIMED_MODULES:
        monkeypatch.setattr(f"{module}.time", clock)
    return clock


@pytest.fixture
def quiet():
    """Silence the expected warnings of a test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def pytest_configure(config: pytest.Config) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)


__all__ = ["SimulatedBackend"]
