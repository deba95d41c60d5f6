"""A memory budget inside a pipeline stage: the first step is measured with every pass in
flight, and the plan is for that many (NOTE [A stage's passes in flight] in
plan/pipeline/stage_model.py), ``keep_passes`` included where the per-layer policy cannot fit."""

from __future__ import annotations

import pytest
import torch
from helpers import PIPELINE_ORDERS, MLPBlock, assert_bit_identical

from cpu_offload import offload_layers
from cpu_offload.plan.policy_search import PolicySearch
from cpu_offload.plan.schedule_model import LayerCosts, simulate_policy
from cpu_offload.plan.stage_plan import choose_for_stage, stage_rows, stage_step
from cpu_offload.policy.policy import POLICY_CHOICES

WIDTH, ROWS = 64, 256
#: GPipe with 8 micro-batches: all 8 in flight on every stage
GPIPE8 = " ".join([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)])
MiB = 2**20


def stage_layers(count: int = 4) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(MLPBlock(WIDTH) for _ in range(count))


def run_steps(layers, order: str, steps: int) -> list[torch.Tensor]:
    """The gradients of ``steps`` steps of ``order`` (accumulated, no optimizer)."""
    layers.zero_grad(set_to_none=True)
    for _ in range(steps):
        outs = {}
        for step in order.split():
            micro = int(step[1:])
            if step[0] == "F":
                gen = torch.Generator().manual_seed(micro)
                h = torch.randn(ROWS, WIDTH, generator=gen).requires_grad_()
                for layer in layers:
                    h = layer(h)
                outs[micro] = h
            else:
                outs.pop(micro).square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize(
    ("order", "in_flight"), [(PIPELINE_ORDERS["1f1b"], 3), (GPIPE8, 8)], ids=["1f1b", "gpipe8"]
)
def test_the_first_step_is_measured_with_every_pass_in_flight(order, in_flight, capsys):
    layers = stage_layers()
    expected = run_steps(layers, order, 2)
    with offload_layers(
        layers, memory_budget="16MiB", min_offload_numel=0, copy_bandwidth=1e9
    ) as handle:
        actual = run_steps(layers, order, 2)
        assert handle.plan.in_flight == handle.auto.in_flight == in_flight
    assert_bit_identical(expected, actual)
    assert f"every pass of {in_flight} in flight" in capsys.readouterr().out


def test_a_stage_that_cannot_fit_its_passes_by_layer_moves_them_whole(capsys):
    """Eight passes in flight on two layers: by layer, each waiting pass keeps at least its
    last layer (or, checkpointed, its inputs, at a recompute's cost); with one pass kept
    and the others moved whole the stage fits, faster than any per-layer policy that fits."""
    layers = stage_layers(2)
    expected = run_steps(layers, GPIPE8, 2)
    with offload_layers(
        layers, memory_budget="1.5MiB", min_offload_numel=0, copy_bandwidth=1e9
    ) as handle:
        actual = run_steps(layers, GPIPE8, 2)
        plan, synchronizer = handle.plan, handle.offload_synchronizer
        assert plan.fits and plan.in_flight == 8 and plan.keep_passes == 1
        assert synchronizer.keep_passes == 1
        # step 2 ran the plan: 7 passes of 8 moved whole, all back in time
        assert synchronizer.stats.passes_moved_whole == 7
        assert synchronizer.stats.on_demand_reloads == 0
        assert "keep 1 pass, others moved whole" in repr(handle)
    assert_bit_identical(expected, actual)
    said = capsys.readouterr().out
    assert "keep 1 pass, 7 of 8 moved whole" in said and "predicted peak" in said


def costs(saved: int, kept: int = 0, inputs: int = 0) -> LayerCosts:
    return LayerCosts(saved, saved - kept, kept, 1e-3, 2e-3, inputs, inputs)


def test_the_stage_peak_counts_the_passes_that_wait():
    """The arithmetic of NOTE [A stage's passes in flight], eight passes in flight, on two
    layers of 4 MiB that cannot be checkpointed and a link too fast to expose copies: by
    layer each waiting pass keeps what its policy keeps at the end of its forward; moved
    whole it keeps nothing, and comes back a layer at a time: the pass in backward holds
    its two layers, the one brought back its last layer."""
    layer = costs(4 * MiB)
    search = PolicySearch.of_layers([layer] * 2, 1e12, 1e12, hazards=[["no"]] * 2)
    row = simulate_policy(["offload", "keep"], [layer] * 2, 1e12, 1e12)
    assert row.end_of_forward_bytes == 4 * MiB  # the last layer
    by_layer = row.peak_bytes + 7 * row.end_of_forward_bytes  # the best per-layer policy
    plan = choose_for_stage(search, 8 * 8 * MiB, None, in_flight=8)  # all fits: keep all
    assert plan.runs() == "0-1 keep; every pass of 8 in flight" and plan.keep_passes is None
    assert plan.predicted.peak_bytes == 8 * 8 * MiB
    # the pass in backward (both layers) and the last layer of the one brought back; a
    # whole pass brought back at once would add its first layer (16 MiB)
    moved_whole = 3 * 4 * MiB
    plan = choose_for_stage(search, moved_whole, None, in_flight=8)
    assert moved_whole < by_layer and (plan.keep_passes, plan.fits) == (1, True)
    assert plan.predicted.peak_bytes == moved_whole
    assert plan.runs().endswith("; keep 1 pass, 7 of 8 moved whole")
    # two kept passes (8 MiB each) beside a moved pass's forward or last layer back
    kept_two = choose_for_stage(search, 20 * MiB, None, in_flight=8)
    assert kept_two.keep_passes == 2 and kept_two.predicted.peak_bytes == 20 * MiB
    closest = choose_for_stage(search, moved_whole - MiB, None, in_flight=8)
    assert not closest.fits and "8 forward passes in flight" in closest.why
    assert closest.predicted.peak_bytes == moved_whole
    assert choose_for_stage(search, by_layer, None, in_flight=1).in_flight == 1


def test_a_moved_pass_holds_its_checkpointed_layers_recompute_in_backward():
    """Two layers of 4 MiB (1 MiB of inputs), the first offloaded and the second
    checkpointed, four passes in flight, one kept: the backward of a pass moved whole
    holds, at its checkpointed last layer, the layer's recompute (4 MiB, not its 1 MiB of
    inputs) beside its first layer being reloaded (4 MiB), while the next pass brought back
    holds its last layer's inputs (1 MiB); the closed form that ranks the candidates says
    the same as the stage model."""
    layer = costs(4 * MiB, inputs=MiB)
    search = PolicySearch.of_layers([layer] * 2, 1e12, 1e12)
    choices = ["offload", "checkpoint"]
    code = next(i for i, c in enumerate(search.codes) if [POLICY_CHOICES[x] for x in c] == choices)
    assert stage_step(search, search.codes[code], 1, 4).peak_bytes == 9 * MiB
    rows, keeps, peaks, _, _ = stage_rows(search, 4)
    assert peaks[(rows == code) & (keeps == 1)].tolist() == [9 * MiB]
