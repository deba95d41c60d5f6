"""``cuda_graph=`` end to end on the modeled H100 (issue 53): a training step captured by
``torch.cuda.graph`` under ``modeled_cuda`` and replayed, and per-layer graphs made by
torch's own ``make_graphed_callables``.  The model's capture refuses what CUDA refuses
(host synchronisations, waits across the capture's boundary, unjoined side streams,
allocations outside the graph's pool: NOTE [Modeled CUDA graphs] in testing/), so a
capture that completes kept those rules; each replay must move what an eager step moves,
with no host synchronisation."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from cuda_graph_steps import InContext, Outer, step
from helpers import MLPBlock

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.engine.layer_context import CAPTURE_REFUSED
from cpu_offload.errors import CpuOffloadError
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.cuda_graphs import CaptureError
from cpu_offload.testing.modeled_cuda import modeled_cuda

H, L, K, REPLAYS = 512, 4, 2, 3


def blocks() -> torch.nn.ModuleList:
    return torch.nn.ModuleList(MLPBlock(H, 4, device="meta") for _ in range(L))


def activations() -> torch.Tensor:
    return torch.empty(8 * H, H, device="cuda", requires_grad=True)


def eager_steps(steps: int) -> tuple[int, int, int]:
    """An eager run's bytes moved per step (d2h, h2d) and its peak once the gradients
    exist (the steady state a replay runs in)."""
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0)
        layers, x = blocks(), activations()
        for _ in range(steps):
            step(layers, x, ctx, sync_fn)
        torch.cuda.synchronize()
    return run.d2h_bytes // steps, run.h2d_bytes // steps, run.peak_bytes


def replays(live: Any, replay: Any) -> list[tuple[int, int, int]]:
    """Per replay: its bytes to the host and back, and the host synchronisations it made."""
    found = []
    for _ in range(REPLAYS):
        copied, syncs = dict(live.timeline.copied), live.timeline.host_syncs
        replay()
        found.append(
            (
                live.timeline.copied["d2h"] - copied["d2h"],
                live.timeline.copied["h2d"] - copied["h2d"],
                live.timeline.host_syncs - syncs,
            )
        )
    return found


def test_a_training_step_captured_once_replays_what_an_eager_step_moves():
    d2h, h2d, eager_peak = eager_steps(2)
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        live = run.live
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        layers, x = blocks(), activations()
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch's recipe does
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(layers, x, ctx, sync_fn)  # also allocates the gradients
        torch.cuda.current_stream().wait_stream(side)
        pinned = ctx.offload_synchronizer.host_memory_stats()["num_host_alloc"]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            syncs = live.timeline.host_syncs
            step(layers, x, ctx, sync_fn)
            syncs_in_capture = live.timeline.host_syncs - syncs
        held = live.memory_allocated()
        found = replays(live, graph.replay)
        assert live.memory_allocated() == held  # replays allocate nothing
        torch.cuda.synchronize()
    assert syncs_in_capture == 0
    assert found == [(d2h, h2d, 0)] * REPLAYS and d2h > 0
    assert held == run.peak_bytes == eager_peak  # the graph's pool holds the eager step's peak
    assert ctx.offload_synchronizer.host_memory_stats()["num_host_alloc"] == pinned
    report = ctx.report()
    assert report.copied_bytes == d2h and report.host_allocations == 0
    scalars = report.to_dict()
    assert scalars["cuda_graph/captured"] == scalars["cuda_graph/replay"] == 1
    assert scalars["cuda_graph/warmup_steps"] == 1


@pytest.mark.parametrize("api", ["get_cpu_offload_context", "offload_layers"])
def test_per_layer_graphs_of_make_graphed_callables_replay_what_eager_moves(api):
    d2h, h2d, _ = eager_steps(1)
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        live = run.live
        layers = blocks()
        if api == "get_cpu_offload_context":
            ctx, sync_fn = get_cpu_offload_context(
                True, K, L, min_offload_numel=0, cuda_graph="layer"
            )
            callables = tuple(InContext(layer, ctx, sync_fn) for layer in layers)
            report = ctx.report
        else:
            handle = offload_layers(layers, K, min_offload_numel=0, cuda_graph="layer")
            callables = tuple(Outer(layer) for layer in layers)
            report = handle.report
        samples = tuple((activations(),) for _ in range(L))
        graphed = torch.cuda.make_graphed_callables(callables, samples)
        x = activations()

        def training_step() -> None:
            y = x
            for layer in graphed:
                y = layer(y)
            y.sum().backward()

        found = replays(live, training_step)
        torch.cuda.synchronize()
    assert found == [(d2h, h2d, 0)] * REPLAYS and d2h > 0
    steps = report().cuda_graph
    assert (steps.captured, steps.replay, steps.captures) == (True, True, 1)
    assert steps.warmup_steps == 3 * L  # make_graphed_callables' warm-up, per layer
    assert report().copied_bytes == d2h


def test_per_layer_graphs_under_the_step_schedule_fail_with_cudas_error():
    """``cuda_graph=True`` leaves a layer's offload for a later graph to join: the
    capture ends with CUDA's error, never a silent wrong run (pass ``"layer"``)."""
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        callables = tuple(InContext(layer, ctx, sync_fn) for layer in blocks())
        samples = tuple((activations(),) for _ in range(L))
        with pytest.raises(CaptureError) as raised:
            torch.cuda.make_graphed_callables(callables, samples)
        kind = raised.value.kind
        del raised  # its frames hold the captured graph: let it go inside the model
        gc.collect()
    assert kind == "cudaErrorStreamCaptureUnjoined"


def test_the_default_mode_under_capture_says_to_pass_cuda_graph():
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0)
        callables = tuple(InContext(layer, ctx, sync_fn) for layer in blocks())
        samples = tuple((activations(),) for _ in range(L))
        with pytest.raises(CpuOffloadError) as raised:
            torch.cuda.make_graphed_callables(callables, samples)
    assert str(raised.value) == CAPTURE_REFUSED
    assert "Pass cuda_graph=True" in str(raised.value)


def policy_replays(policy: list[str], cuda_graph: bool) -> tuple[list, Any]:
    """An eager warm-up step of ``offload_layers(policy=...)``, then three steps: eager, or
    replays of the next step captured; what each moved, and the handle's report."""
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        layers, x = blocks(), activations()
        handle = offload_layers(layers, policy=policy, min_offload_numel=0, cuda_graph=cuda_graph)

        def training_step() -> None:
            y = x
            for layer in layers:
                y = layer(y)
            y.sum().backward()

        training_step()
        replay = training_step
        if cuda_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                training_step()
            replay = graph.replay
        moved = replays(run.live, replay)
        torch.cuda.synchronize()
        handle.remove()
    return moved, handle.report()


def test_a_policy_with_checkpoints_captured_as_a_step_replays_what_eager_moves():
    """Checkpointed layers recompute inside the captured backward (their forward there
    passes through the context), so the replay repeats the recompute and the copies."""
    policy = ["checkpoint+offload", "checkpoint", "offload", "keep"]
    eager, _ = policy_replays(policy, False)
    graphed, report = policy_replays(policy, True)
    assert graphed == eager and eager[0][0] > 0
    assert report.cuda_graph.replay and report.recomputed_layers == [0, 1]


def test_layers_graphed_outside_the_context_say_that_nothing_moves():
    """Layers graphed on their own with the context entered around each graphed call
    (as Megatron's blocks enter it) save nothing the context sees: one warning says so,
    and what to do, instead of a run that silently offloads nothing."""
    from cpu_offload.graphs.graph_synchronizer import GRAPHED_OUTSIDE

    with timed_runtime("h100") as run, modeled_cuda(run.live):
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph="layer")
        graphed = torch.cuda.make_graphed_callables(
            tuple(blocks()), tuple((activations(),) for _ in range(L))
        )
        x = activations()
        with pytest.warns(UserWarning) as warned:
            for _ in range(2):
                y = x
                for layer in graphed:
                    with ctx:
                        y = layer(y)
                    y = sync_fn(y)
                y.sum().backward()
        torch.cuda.synchronize()
    assert [str(w.message) for w in warned] == [GRAPHED_OUTSIDE]
    assert run.d2h_bytes == 0
