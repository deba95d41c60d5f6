"""A layer entered while its stream is captured into a CUDA graph: one clear error, not a
run whose copies and host buffers a replay would bake in (issue 53: until a capture mode
exists)."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.device.runtime import StreamBackend
from cpu_offload.engine.layer_context import CAPTURE_REFUSED
from cpu_offload.errors import CpuOffloadError


def layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))


def test_a_layer_hooked_by_offload_layers_refuses_capture_then_runs_after_it():
    model, x = layers(), torch.randn(512, 64, requires_grad=True)
    handle = offload_layers(model, 1, min_offload_numel=0)
    backend = handle.offload_synchronizer.backend
    backend.is_capturing = lambda: True  # type: ignore[method-assign]
    with pytest.raises(CpuOffloadError) as raised:
        model(x)
    assert str(raised.value) == CAPTURE_REFUSED
    assert "handle.enabled = False" in str(raised.value)
    handle.enabled = False  # the advice: offload off around the capture
    model(x).sum().backward()
    del backend.is_capturing  # the capture is over: the next step offloads again
    handle.enabled = True
    expected = layers()
    expected(x.detach().requires_grad_()).sum().backward()
    model.zero_grad()
    model(x).sum().backward()
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), expected.parameters())
    )
    handle.remove()


def test_the_context_api_refuses_capture():
    ctx, sync = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    ctx.offload_synchronizer.backend.is_capturing = lambda: True
    with pytest.raises(CpuOffloadError, match="being captured into a CUDA graph"):
        with ctx:
            pass


def test_a_stream_runtime_asks_its_module_whether_it_captures():
    class Runtime:
        capturing = False

        def is_current_stream_capturing(self) -> bool:
            return self.capturing

    runtime = Runtime()
    backend = StreamBackend(torch.device("cpu"), runtime, runtime_type="cuda")
    assert not backend.is_capturing()
    runtime.capturing = True
    assert backend.is_capturing()
    assert not StreamBackend(torch.device("cpu"), object(), runtime_type="cuda").is_capturing()
