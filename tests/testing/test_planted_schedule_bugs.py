"""Schedule bugs the ordering checks cannot see, caught by the modeled accelerator.

Each test plants one bug by monkeypatching, runs the same step with and without it in
the data mode of ``timed_runtime`` (the strict simulator underneath: no hazard may
raise) and checks that the gradients are still those of a run without offload (so every
ordering test would pass), and that the model's figures move: exposed copy time, step
time, host stalls or peak memory.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MLPBlock, modeled_device

from cpu_offload import get_cpu_offload_context
from cpu_offload.engine import synchronizer as synchronizer_module
from cpu_offload.engine.layer_data import LayerData
from cpu_offload.engine.offload_engine import OffloadEngine
from cpu_offload.engine.synchronizer import DefaultOffloadSynchronizer
from cpu_offload.testing import TimedReport, timed_runtime

WIDTH, ROWS = 128, 512
#: what a layer saves: its input, and the up projection's output and GELU's (2 x WIDTH)
LAYER_BYTES = 5 * ROWS * WIDTH * 4
#: a device on which one layer's copy (1.25 MiB, 66 us) hides behind its forward (~90 us)
DEVICE = modeled_device(link_bytes_per_s=2e10, host_issue_s=1e-6)


def step(layers: torch.nn.ModuleList, k: int | None) -> tuple[TimedReport, list[torch.Tensor]]:
    """One step on the modeled device with real data (``k=None``: without offload)."""
    layers.zero_grad(set_to_none=True)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with timed_runtime(DEVICE, data=True) as run:
        if k is not None:
            ctx, sync_fn = get_cpu_offload_context(True, k, len(layers), min_offload_numel=0)
        h = x
        for layer in layers:
            if k is None:
                h = layer(h)
                continue
            with ctx:
                h = layer(h)
            h = sync_fn(h)
        h.sum().backward()
    return run, [x.grad, *(p.grad for p in layers.parameters())]


def correct_and_planted(k: int, layers: int, plant: object) -> tuple[TimedReport, TimedReport]:
    """The run without the bug, and with it (``plant`` patches it in); both must compute
    the gradients of a run without offload."""
    stack = torch.nn.ModuleList(MLPBlock(WIDTH) for _ in range(layers))
    _, expected = step(stack, None)
    correct, gradients = step(stack, k)
    assert all(torch.equal(a, b) for a, b in zip(gradients, expected))
    with pytest.MonkeyPatch.context() as patch:
        plant(patch)  # type: ignore[operator]
        planted, gradients = step(stack, k)
    assert all(torch.equal(a, b) for a, b in zip(gradients, expected))  # ordering: fine
    return correct, planted


def test_the_correct_schedule_hides_its_copies_on_this_device():
    stack = torch.nn.ModuleList(MLPBlock(WIDTH) for _ in range(4))
    run, _ = step(stack, 2)
    assert run.exposed_copy_s == 0 and run.host_syncs == 0
    assert run.d2h_bytes == run.h2d_bytes == 2 * LAYER_BYTES


def test_a_reload_one_layer_late_is_exposed():
    """Reloads start one layer later in backward: with k = L - 2 the default schedule
    prefetches one layer ahead, so a late reload runs while compute waits for it."""
    schedule_points = synchronizer_module.schedule_points

    def late(patch: pytest.MonkeyPatch) -> None:
        def points(model_layers: int, offloaded: list[int]) -> dict[int, tuple[int, int]]:
            return {
                layer: (release, reload - 1)
                for layer, (release, reload) in schedule_points(model_layers, offloaded).items()
            }

        patch.setattr(synchronizer_module, "schedule_points", points)

    correct, planted = correct_and_planted(2, 4, late)
    copy = LAYER_BYTES / DEVICE.h2d  # one layer's reload
    assert correct.exposed_copy_s == 0
    assert planted.exposed_copy_s > 1.5 * copy  # both reloads in full
    assert planted.step_s > correct.step_s + 1.5 * copy


def test_a_release_waiting_on_the_wrong_event_is_exposed():
    """The release waits for everything on the offload stream (an event recorded there
    now) instead of the layer's own copies: the copy of the layer just offloaded too."""

    def wrong_event(patch: pytest.MonkeyPatch) -> None:
        def wait_for_copies(self: LayerData, layer: object) -> None:
            if self.in_flight:
                backend = layer.backend  # type: ignore[attr-defined]
                latest = backend.record_event(layer.offload_stream)  # type: ignore[attr-defined]
                backend.wait_event(backend.current_stream(), latest)
                self.in_flight = []

        patch.setattr(LayerData, "wait_for_copies", wait_for_copies)

    correct, planted = correct_and_planted(2, 4, wrong_event)
    copy = LAYER_BYTES / DEVICE.d2h
    assert correct.exposed_copy_s == 0
    assert planted.exposed_copy_s > 0.5 * copy
    assert planted.step_s > correct.step_s + 0.5 * copy


def test_a_host_synchronisation_per_layer_stalls_the_step():
    def sync_per_layer(patch: pytest.MonkeyPatch) -> None:
        on_forward = DefaultOffloadSynchronizer._on_forward

        def synchronising(self: DefaultOffloadSynchronizer, forward_pass, layer) -> None:  # noqa: ANN001
            on_forward(self, forward_pass, layer)
            self.backend.synchronize()

        patch.setattr(DefaultOffloadSynchronizer, "_on_forward", synchronising)

    correct, planted = correct_and_planted(2, 4, sync_per_layer)
    assert correct.host_syncs == 0 and planted.host_syncs == 4  # one per layer's forward
    assert planted.host_sync_s > 0 and planted.host_bound_s > correct.host_bound_s
    copy = LAYER_BYTES / DEVICE.d2h
    assert planted.step_s > correct.step_s + 0.5 * copy  # the host waited for copies


def test_a_missing_record_stream_holds_reloaded_memory_to_the_end_of_backward():
    """Without ``record_stream`` for the copy stream, a reloaded block may be freed only
    once that stream is known to be done: code that keeps it to the end of backward (the
    safe fallback) holds every reloaded layer at once."""
    held: list[list[torch.Tensor]] = []

    def hold(patch: pytest.MonkeyPatch) -> None:
        copy_in = LayerData.copy_in

        def holding(self: LayerData, layer: object) -> None:
            copy_in(self, layer)  # type: ignore[arg-type]
            held.append(list(self.reloaded))  # the tensors, not the layer's list

        patch.setattr(LayerData, "copy_in", holding)

    correct, planted = correct_and_planted(3, 4, hold)
    held.clear()
    assert planted.peak_bytes >= correct.peak_bytes + LAYER_BYTES  # two more layers, at least
    assert planted.step_s == pytest.approx(correct.step_s)  # time does not tell


def test_copies_serialised_on_the_compute_stream_are_exposed():
    def on_compute(patch: pytest.MonkeyPatch) -> None:
        patch.setattr(
            OffloadEngine, "offload_stream", property(lambda self: self.backend.current_stream())
        )

    correct, planted = correct_and_planted(2, 4, on_compute)
    copies = 2 * LAYER_BYTES / DEVICE.d2h  # out and back, two layers
    assert correct.exposed_copy_s == 0
    assert planted.exposed_copy_s == pytest.approx(2 * copies, rel=0.05)
    assert planted.step_s > correct.step_s + 1.5 * copies
