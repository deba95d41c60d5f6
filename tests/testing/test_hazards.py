"""Planted bugs: each missing synchronisation must be caught by strict_streams()."""

from __future__ import annotations

import pytest
import torch
from helpers import forward, make_input, make_layers, without_event_waits

from cpu_offload import OffloadableLayerState, get_cpu_offload_context
from cpu_offload.engine.host_buffers import HostBufferPool
from cpu_offload.testing import StreamHazardError, strict_streams

WIDTH = 32


def train(layers, offloaded=None, inputs=(1,), retain=False, interleave=False):
    """Gradients of one step; ``interleave`` runs all forwards before the backwards."""
    layers.zero_grad(set_to_none=True)
    ctx = sync_fn = None
    if offloaded is not None:
        ctx, sync_fn = get_cpu_offload_context(
            True, offloaded, len(layers), min_offload_numel=0, retain_pinned_cpu_buffers=retain
        )
    xs = [make_input("mlp", WIDTH, torch.float32, seed).requires_grad_() for seed in inputs]
    if interleave:
        outs = [forward(layers, x, ctx, sync_fn) for x in xs]
        for out in outs:
            out.square().mean().backward()
    else:
        for x in xs:
            forward(layers, x, ctx, sync_fn).square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()]


def test_hazard_pop_without_reload_wait(monkeypatch):
    without_event_waits(monkeypatch, "pop_leased")
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    with pytest.raises(StreamHazardError, match="handed back to autograd while the copy"):
        with strict_streams():
            train(layers, offloaded=2)


def test_hazard_release_before_offload_finished(monkeypatch):
    original_release = OffloadableLayerState.release_activation_forward_gpu_memory

    def release_then_wait(self):
        (finish_event,) = self._data.in_flight
        self._data.in_flight = []  # forget the copies in flight
        original_release(self)  # drops the device tensors first ...
        self.backend.wait_event(self.backend.current_stream(), finish_event)  # ... waits after

    monkeypatch.setattr(
        OffloadableLayerState, "release_activation_forward_gpu_memory", release_then_wait
    )
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    with pytest.raises(StreamHazardError, match="freed before the copy ran"):
        with strict_streams():
            train(layers, offloaded=2)


def test_hazard_copy_before_ready_event(monkeypatch):
    without_event_waits(monkeypatch, "start_offload")
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    with pytest.raises(StreamHazardError, match="missing wait on the tensor's ready event"):
        with strict_streams():
            train(layers, offloaded=2)


def _modify_after_copy_started(ctx, sync_fn):
    """Layer 1 modifies layer 0's saved output while its copy is queued, then drops it."""
    x = torch.randn(8, 4, requires_grad=True)
    with ctx:
        h = x.exp()  # saves its output
    h = sync_fn(h)
    with ctx:  # layer 0's copy is queued as layer 1 enters
        out = h * 3.0
        h.add_(1)
    del h
    out = sync_fn(out)
    with ctx:
        out = out.sin()
    return sync_fn(out)


def test_a_torn_copy_is_no_hazard_when_the_unpack_refuses_it():
    """NOTE [Torn copies]: compute writing a queued copy's source tears the copy; the
    version check refuses the tensor, so nothing torn reaches autograd."""
    with strict_streams() as sim:
        ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
        out = _modify_after_copy_started(ctx, sync_fn)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    assert sim.counters.torn_copies > 0 and sim.counters.hazards == 0


def test_hazard_torn_copy_handed_back(monkeypatch):
    """Planted bug: the unpack skips the version check and hands back the torn copy."""
    monkeypatch.setattr(OffloadableLayerState, "_raise_modified", lambda self, *args: None)
    with strict_streams():
        ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
        out = _modify_after_copy_started(ctx, sync_fn)
        with pytest.raises(StreamHazardError, match="holding torn data"):
            out.sum().backward()


def test_hazard_retained_buffer_shared_by_passes_in_flight(monkeypatch):
    """A pool that hands a layer's retained buffers to a second pass in flight."""
    original_acquire = HostBufferPool.acquire
    shared: dict[int, list[torch.Tensor]] = {}

    def acquire_shared(self, layer_index, tensors, sizes=None, layouts=None):
        if layer_index not in shared:
            shared[layer_index] = original_acquire(self, layer_index, tensors, sizes, layouts)
        return shared[layer_index]

    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    expected = train(layers, inputs=(1, 2), interleave=True)
    monkeypatch.setattr(HostBufferPool, "acquire", acquire_shared)
    try:
        with strict_streams():
            actual = train(layers, 2, inputs=(1, 2), retain=True, interleave=True)
    except StreamHazardError:
        return
    assert not all(torch.equal(a, b) for a, b in zip(expected, actual))


def test_hazard_release_all_without_waiting_for_unpopped_reloads(monkeypatch):
    """Dropping reloaded tensors nobody popped while their copies are queued."""
    original = OffloadableLayerState.release_all_memory

    def release_without_wait(self):
        if self.state.name == "RELOAD_STARTED":
            self._data.in_flight = []  # forget the reloads in flight
        return original(self)

    monkeypatch.setattr(OffloadableLayerState, "release_all_memory", release_without_wait)
    with pytest.raises(StreamHazardError, match="of a queued copy.*was freed before the copy ran"):
        with strict_streams():
            ctx, sync_fn, controller = get_cpu_offload_context(
                True, model_layers=1, manual_synchronization=True, min_offload_numel=0
            )
            x = torch.randn(16, 16, requires_grad=True)
            with ctx:
                y = x.sin()  # saves x
            y = sync_fn(y)
            controller.start_offload_layer(0)
            controller.release_activation_forward_gpu_memory(0)
            controller.start_reload_layer(0)
            controller.layer_states[0].release_all_memory()  # before any pop


def test_the_correct_code_has_no_hazard():
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    expected = train(layers, inputs=(1, 2), interleave=True)
    with strict_streams() as sim:
        actual = train(layers, 2, inputs=(1, 2), retain=True, interleave=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert sim.counters.hazards == 0 and sim.counters.copies_run == sim.counters.copies_queued


def _inplace_error_after_the_copy(k: int) -> RuntimeError:
    """A saved tensor modified after its copy: the unpack in backward raises."""
    ctx, sync_fn = get_cpu_offload_context(True, k, 3, min_offload_numel=0)
    x = torch.randn(8, 4, requires_grad=True)
    h = saved = x * 1.0
    for index, fn in enumerate([torch.sin, torch.cos, torch.exp]):
        with ctx:
            out = fn(h)
            if index == 2:
                saved.mul_(2)  # saved by layer 0, copied out when layer 1 entered
        h = sync_fn(out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as error:
        h.sum().backward()
    return error.value


@pytest.mark.parametrize("threshold", [1, 7, 30])
def test_collections_at_any_moment_leave_no_copy_unwaited(streams, threshold):
    """A garbage collection may run a layer's finalizer in the middle of anything (a
    simulated copy included): in-place errors raised inside unpacks, their graphs freed
    with the errors' tracebacks by the collector; no copy is left unwaited."""
    import gc

    old = gc.get_threshold()
    gc.set_threshold(threshold, 2, 2)
    try:
        for _ in range(3):
            for k in (1, 2):
                error = _inplace_error_after_the_copy(k)
                del error
        gc.collect()
    finally:
        gc.set_threshold(*old)
