"""The default schedule (docs/design.md, "The default schedule"), checked against an event log."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import OffloadableLayerState, get_cpu_offload_context

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

TRANSITIONS = [
    "start_offload",
    "release_activation_forward_gpu_memory",
    "start_reload",
    "release_all_memory",
]


def record_schedule(monkeypatch, num_layers: int, offloaded: int) -> list[tuple]:
    """Run one forward and backward, logging (phase, step, transition, layer)."""
    log: list[tuple] = []
    step = {"phase": None, "index": None}
    for name in TRANSITIONS:
        original = getattr(OffloadableLayerState, name)

        def logged(self, _original=original, _name=name):
            log.append((step["phase"], step["index"], _name, self.layer_index))
            return _original(self)

        monkeypatch.setattr(OffloadableLayerState, name, logged)

    ctx, sync_fn = get_cpu_offload_context(True, offloaded, num_layers, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    forward_step, bwd_step, finish = (
        synchronizer.forward_step,
        synchronizer.bwd_step,
        synchronizer.finish_part_of_bwd,
    )

    def logged_fwd():
        step.update(
            phase="fwd",
            index=synchronizer.current_pass.layers_forwarded
            if synchronizer.current_pass and not synchronizer.current_pass.forward_done
            else 0,
        )
        return forward_step()

    def logged_bwd(layer, forward_pass=None):
        step.update(phase="bwd", index=layer)
        return bwd_step(layer, forward_pass)

    def logged_finish(forward_pass=None):
        step.update(phase="finish", index=None)
        return finish(forward_pass)

    monkeypatch.setattr(synchronizer, "forward_step", logged_fwd)
    monkeypatch.setattr(synchronizer, "bwd_step", logged_bwd)
    monkeypatch.setattr(synchronizer, "finish_part_of_bwd", logged_finish)

    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(num_layers):
        with ctx:
            x = x.sin()
        x = sync_fn(x)
    x.sum().backward()
    return log


def expected_schedule(L: int, k: int) -> list[tuple]:
    """The schedule of docs/design.md, written out independently of the implementation."""
    log = []
    for j in range(L):
        if 1 <= j and j - 1 < k:
            log.append(("fwd", j, "start_offload", j - 1))
        for i in range(k):
            if j == L - k + i:
                log.append(("fwd", j, "release_activation_forward_gpu_memory", i))
    for j in reversed(range(L)):
        if j + 1 < k:  # a layer that is not offloaded has no state to release
            log.append(("bwd", j, "release_all_memory", j + 1))
        for i in range(k):
            if j == L - 1 - k + i:
                log.append(("bwd", j, "start_reload", i))
    if k:
        log.append(("finish", None, "release_all_memory", 0))
    return log


@pytest.mark.parametrize(
    "L,k", [(2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (8, 7)], ids=lambda v: str(v)
)
def test_default_schedule_matches_spec(streams, monkeypatch, quiet, L, k):
    assert record_schedule(monkeypatch, L, k) == expected_schedule(L, k)


def test_worked_example_l4_k2(monkeypatch, streams):
    """The example of docs/design.md, spelled out."""
    assert record_schedule(monkeypatch, 4, 2) == [
        ("fwd", 1, "start_offload", 0),
        ("fwd", 2, "start_offload", 1),
        ("fwd", 2, "release_activation_forward_gpu_memory", 0),
        ("fwd", 3, "release_activation_forward_gpu_memory", 1),
        ("bwd", 2, "start_reload", 1),
        ("bwd", 1, "start_reload", 0),
        ("bwd", 0, "release_all_memory", 1),
        ("finish", None, "release_all_memory", 0),
    ]


def test_no_layer_offloaded_when_k_is_zero(monkeypatch, streams):
    assert record_schedule(monkeypatch, 3, 0) == []


def test_only_offloaded_layers_get_a_state(streams):
    """A pass makes a layer's state when the layer first needs one: never for a layer
    that is not offloaded (its tensors stay with autograd)."""
    ctx, sync_fn = get_cpu_offload_context(
        True, model_layers=4, offloaded_layers=[0, 2], min_offload_numel=0
    )
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(4):
        with ctx:
            x = x.sin()
        x = sync_fn(x)
    forward_pass = ctx.offload_synchronizer.in_flight_passes()[-1]
    assert [forward_pass.made_state(i) is not None for i in range(4)] == [True, False, True, False]
    x.sum().backward()
    assert ctx.offload_synchronizer.stats.tensors_offloaded == 2
    assert len(forward_pass.layer_states) == 4  # the public list makes the rest


def test_repeated_iterations_start_new_passes(streams):
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    for _iteration in range(4):
        x = torch.randn(4, 8, requires_grad=True)
        for layer in range(3):
            with ctx:
                x = x.sin()
            assert synchronizer.current_pass is None or layer < 2
            x = sync_fn(x)
        x.sum().backward()
        assert synchronizer.get_offloaded_total_size_mb() == 0
    assert synchronizer.stats.forward_passes == 4
    assert synchronizer.stats.tensors_offloaded == 4
