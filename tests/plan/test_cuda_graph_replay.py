"""``plan --cuda-graph`` against the real offload code, its step captured whole with
``offload_layers(..., cuda_graph=True)`` and replayed on the modeled H100 (NOTE [Modeled
CUDA graphs] in testing/cuda_graphs.py; NOTE [Planning a captured step] in
plan/planner.py): each replay takes the step time and moves the bytes the planner
predicts for the captured step, and the graph's pool holds its predicted peak."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest
import torch

from cpu_offload import offload_layers
from cpu_offload.bench.config import parse_args
from cpu_offload.bench.simulate import modeled_step, stack_of
from cpu_offload.plan import plan_offload
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda

REPLAYS = 3


@dataclass
class Replayed:
    """A step captured once and replayed :data:`REPLAYS` times."""

    step_s: list[float]  # each replay: from its launch to the compute stream's end
    moved_bytes: list[int]  # bytes copied to the host by each replay
    counted_peak_bytes: int  # the pool's live bytes at the layer boundaries, counted
    held_bytes: list[int]  # device memory after each replay
    pool_bytes: int  # what the graph's pool holds (its capture's peak)


def captured_step(layers: torch.nn.ModuleList, x: torch.Tensor, k: int, numel: int) -> Replayed:
    """A warm-up step on a side stream, then the step captured in one graph (gradients set
    to None first, so that the backward allocates them in the graph's pool, as torch's
    whole-network example does) and replayed.  At each layer boundary of the capture the
    pool's live bytes are counted as ``modeled_step`` counts device memory (less the
    output, the gradients flowing back and the parameters' gradients)."""
    params = list(layers.parameters())
    marks: list[int] = []
    with timed_runtime("h100", record=False) as run, modeled_cuda(run.live):
        live = run.live
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # k = L - 1 cannot hide its copies
            handle = offload_layers(layers, k, cuda_graph=True, min_offload_numel=numel)
        pool_handle = torch.cuda.graph_pool_handle()
        pool = live.graph_pool(pool_handle)

        def count(not_counted: Iterable[torch.Tensor | None]) -> None:
            if not live.is_current_stream_capturing():
                return  # the warm-up
            blocks = {}  # the distinct blocks of the pool that they hold
            for tensor in not_counted:
                block = None if tensor is None else live.memory.block(tensor)
                if block is not None and block.pool is pool:
                    blocks[id(block)] = block.size
            marks.append(pool.live - sum(blocks.values()))

        def step() -> None:
            output: list[torch.Tensor] = []

            def reached(grads: tuple[torch.Tensor, ...]) -> None:
                count([*grads, *output, *(p.grad for p in params)])

            h = x.clone()
            for layer in layers:
                h = layer(h)
                count([h])
                h.grad_fn.register_prehook(reached)
            output.append(h)
            h.float().square().mean().backward()

        for tensor in [x, *params]:
            tensor.grad = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        for tensor in [x, *params]:
            tensor.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool_handle):
            step()
        steps, moved, held = [], [], []
        for _ in range(REPLAYS):
            torch.cuda.synchronize()
            start, copied = live.timeline.host, live.timeline.copied["d2h"]
            graph.replay()
            steps.append(live.compute.clock.time - start)
            moved.append(live.timeline.copied["d2h"] - copied)
            held.append(live.memory_allocated())
        torch.cuda.synchronize()
        handle.remove()
    return Replayed(steps, moved, max(marks), held, pool.reserve)


def llama(preset: str, *flags: str) -> Callable[[], tuple]:
    config = parse_args(["--preset", preset, "--layers", "4", *flags, "--simulate", "h100"])
    return lambda: (*stack_of(config), config.min_offload_numel)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_replayed_step_takes_the_time_and_memory_the_planner_predicts(k):
    """Llama-3-8B layers at 1k tokens (as the planner-vs-model tests run them): every
    replay within 3% of the captured step's predicted time, the bytes moved exact, the
    peak counted at the layer boundaries within 2% of the predicted peak, and the
    graph's pool, which holds at least that peak, held the same after every replay."""
    layers, x, layer, numel = llama("llama8b-layer", "--seq", "1024")()
    plan = plan_offload(layer, 4, "h100", cuda_graph=True)
    row = plan.rows[k]
    replayed = captured_step(layers, x, k, numel)
    for step_s in replayed.step_s:
        assert step_s - plan.graph_launch_s == pytest.approx(row.step_s, rel=0.03)
    assert replayed.moved_bytes == [row.offloaded_bytes] * REPLAYS
    assert replayed.counted_peak_bytes == pytest.approx(row.peak_bytes, rel=0.02)
    assert replayed.held_bytes == [replayed.held_bytes[0]] * REPLAYS
    assert replayed.pool_bytes >= row.peak_bytes  # with the gradients and temporaries


def test_a_launch_bound_step_replays_at_its_device_time_as_predicted():
    """The tiny preset is launch-bound on the H100: eagerly the modeled step runs at the
    host's pace, twice the device's time; replayed it takes the device time that
    ``--cuda-graph`` predicts (within 3%), which the eager plan misses by half."""
    layers, x, layer, numel = llama("tiny")()
    eager_plan = plan_offload(layer, 4, "h100")
    plan = plan_offload(layer, 4, "h100", cuda_graph=True)
    eager = modeled_step(layers, x, plan.device, k=0, min_offload_numel=numel, record=False)
    replayed = captured_step(layers, x, 0, numel)
    predicted = plan.rows[0].step_s
    assert eager.step_s == pytest.approx(eager_plan.rows[0].step_s, rel=0.03)
    assert eager.step_s > 2 * predicted
    for step_s in replayed.step_s:
        assert step_s - plan.graph_launch_s == pytest.approx(predicted, rel=0.03)
