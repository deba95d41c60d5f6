"""Accelerator checks: measured memory, gradients, no hidden host synchronisation.

They run on the accelerator that is there, a CUDA GPU or an Ascend NPU, and are
skipped without one (marker ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import MLPBlock, forward

from cpu_offload import get_cpu_offload_context
from cpu_offload.device.runtime import available_device_type, get_backend

pytestmark = pytest.mark.gpu
DEVICE = available_device_type()

L, WIDTH, ROWS = 6, 1024, 4096


def make_stack() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(MLPBlock(WIDTH) for _ in range(L)).to(DEVICE)


def activation_bytes(layers, ctx=None, sync_fn=None) -> int:
    """Device bytes held at the end of the forward pass, above what was there before."""
    backend = get_backend(DEVICE)
    x = torch.randn(ROWS, WIDTH, device=DEVICE, requires_grad=True)
    backend.synchronize()
    before = backend.memory_allocated()
    out = forward(layers, x, ctx, sync_fn)
    backend.synchronize()
    held = backend.memory_allocated() - before
    out.sum().backward()
    del out
    backend.synchronize()
    return held


@pytest.mark.parametrize("k", [1, 2, 3])
def test_end_of_forward_memory_matches_analytic(k):
    layers = make_stack()
    activation_bytes(layers)  # warm-up: gradients allocated, allocator warm
    per_layer = activation_bytes(layers) / L  # T
    ctx, sync_fn = get_cpu_offload_context(True, k, L)
    activation_bytes(layers, ctx, sync_fn)  # warm-up with offload
    backend = get_backend(DEVICE)
    backend.synchronize()
    baseline = backend.memory_allocated()
    measured = activation_bytes(layers, ctx, sync_fn)
    expected = (L - k) * per_layer
    assert abs(measured - expected) <= 0.10 * expected, (measured, expected)
    assert backend.memory_allocated() == baseline  # back to baseline after backward


def test_gradients_bit_identical_on_gpu():
    layers = make_stack()
    x = torch.randn(ROWS, WIDTH, device=DEVICE, requires_grad=True)
    forward(layers, x).square().mean().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    ctx, sync_fn = get_cpu_offload_context(True, 3, L)
    for _ in range(3):
        layers.zero_grad()
        forward(layers, x, ctx, sync_fn).square().mean().backward()
        actual = [p.grad.clone() for p in layers.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(expected, actual))


def test_no_host_synchronisation_in_steady_state():
    layers = make_stack()
    ctx, sync_fn = get_cpu_offload_context(True, 2, L, retain_pinned_cpu_buffers=True)
    x = torch.randn(ROWS, WIDTH, device=DEVICE, requires_grad=True)
    for _ in range(2):  # warm-up: buffers allocated
        forward(layers, x, ctx, sync_fn).sum().backward()
    backend = ctx.offload_synchronizer.backend
    backend.synchronize()
    allocations = ctx.offload_synchronizer.host_buffers.allocations
    with backend.count_host_syncs() as syncs:
        for _ in range(3):
            forward(layers, x, ctx, sync_fn).sum().backward()
    if syncs is None:
        pytest.skip(f"host synchronisations are not measurable on {DEVICE}")
    assert syncs == [0], backend.sync_sites
    assert ctx.offload_synchronizer.host_buffers.allocations == allocations
