"""The planner's model of layers reloaded in slices and of gradients allocated in
backward (NOTE [Reloading a layer in slices] in engine/reload_slices.py)."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import numpy as np
import pytest

from cpu_offload.plan.census import LayerProfile
from cpu_offload.plan.many_policies import simulate_many
from cpu_offload.plan.policy_search import PolicySearch, choose_policy, policy_family
from cpu_offload.plan.schedule_model import (
    LayerCosts,
    simulate_policy,
    slice_sizes,
    sliced_backward,
)
from cpu_offload.policy.policy import KEEP, OFFLOAD, POLICY_CHOICES

MIB = 2**20


def make_layer(saved: int, offloaded: int, kept: int) -> LayerProfile:
    """A layer of a Llama's proportions: 2 TFLOP forward, twice that backward."""
    return LayerProfile(
        saved_bytes=saved,
        offloaded_bytes=offloaded,
        kept_bytes=kept,
        kept_by_reason={"small": kept},
        tensors_offloaded=16,
        forward_flops=2 * 10**12,
        backward_flops=4 * 10**12,
        attention="flash",
        min_offload_numel=0,
        input_bytes=saved // 16,
        input_offloaded_bytes=saved // 16,
    )


def test_slice_sizes():
    assert slice_sizes(10, None) == [10]
    assert slice_sizes(10, 10) == [10]
    assert slice_sizes(10, 4) == [4, 4, 2]
    assert slice_sizes(12, 4) == [4, 4, 4]


def costs(gradient_bytes: int = 0) -> LayerCosts:
    return LayerCosts(
        saved_bytes=1000,
        offloaded_bytes=960,
        kept_bytes=40,
        forward_s=1.0,
        backward_s=2.0,
        input_bytes=100,
        input_offloaded_bytes=100,
        gradient_bytes=gradient_bytes,
    )


def test_an_offloaded_layer_in_slices_holds_two_slices_in_its_backward():
    """Two offloaded layers under two kept ones.  Whole, layer 1's reload brings 960
    bytes as layer 2's backward starts, and each offloaded layer's backward holds all
    of it; in slices of 240 a reload brings one slice and a backward holds two.  With
    500 bytes of gradients per layer, counted as backward allocates them, the peak
    moves from layer 1's backward (3000) to the forward's end (2080); the same bytes
    move, and a link that keeps up hides the slices as it hid the whole layers."""
    policy = [OFFLOAD, OFFLOAD, KEEP, KEEP]
    whole = simulate_policy(policy, costs(500), 1e6, 1e6)
    sliced = simulate_policy(policy, costs(500), 1e6, 1e6, reload_slice_bytes=240)
    held = {step: nbytes for step, _, nbytes in whole.log}
    assert (held["bwd 2"], held["bwd 1"], held["bwd 0"]) == (2540, 3000, 2500)
    held = {step: nbytes for step, _, nbytes in sliced.log}
    assert held["bwd 2"] == 1000 + 40 + 240 + 40 + 500  # layer 1's first slice
    assert held["bwd 1"] == 40 + 2 * 240 + 40 + 240 + 1000  # two of 1, the first of 0
    assert held["bwd 0"] == 40 + 2 * 240 + 1500
    assert whole.peak_bytes == 3000 and sliced.peak_bytes == 2080 == sliced.end_of_forward_bytes
    assert sliced.offloaded_bytes == whole.offloaded_bytes == 2 * 960
    assert sliced.step_s == pytest.approx(whole.step_s)


def test_a_slow_link_exposes_the_slices_the_backward_cannot_hide():
    """240 bytes per second, layer 0 reloaded as its backward starts (its reload has
    nothing to hide behind): whole, it waits 4 s for 960 bytes; in four slices it
    waits 1 s for the first, then 0.5 s for each of the three others (a slice comes in
    a second, the one before it is consumed in half)."""
    policy = [OFFLOAD, KEEP]
    whole = simulate_policy(policy, costs(), 1e6, 240.0)
    sliced = simulate_policy(policy, costs(), 1e6, 240.0, reload_slice_bytes=240)
    assert whole.step_s - sliced.step_s == pytest.approx(4.0 - (1.0 + 3 * 0.5))


def test_a_layer_on_demand_holds_one_slice_and_waits_for_each():
    """NOTE [Slices at the peak]: layer 0 on demand holds the slice in use, not the next
    too (240 bytes less in its backward, where the gradients of both layers are), and
    at 240 bytes per second waits a second for each slice instead of half a second
    for the three after the first (issued one slice ahead, consumed in half a second)."""
    policy = [OFFLOAD, KEEP]
    prefetched = simulate_policy(policy, costs(500), 1e6, 240.0, reload_slice_bytes=240)
    on_demand = simulate_policy(
        policy, costs(500), 1e6, 240.0, reload_slice_bytes=240, on_demand=(0,)
    )
    held = {step: nbytes for step, _, nbytes in prefetched.log}
    held_on_demand = {step: nbytes for step, _, nbytes in on_demand.log}
    assert held["bwd 0"] - held_on_demand["bwd 0"] == 240
    assert held["bwd 1"] == held_on_demand["bwd 1"]
    assert on_demand.step_s - prefetched.step_s == pytest.approx(3 * 1.0 - 3 * 0.5)
    assert on_demand.offloaded_bytes == prefetched.offloaded_bytes


def test_gradients_count_from_the_boundary_below_their_layer():
    row = simulate_policy([KEEP, KEEP], costs(500), 1e6, 1e6)
    steps = {step: held for step, _, held in row.log}
    assert steps["bwd 1"] == 2000 and steps["bwd 0"] == 1000 + 500 and steps["end"] == 1000
    assert row.peak_bytes == 2000


def test_the_vectorized_model_agrees_with_the_reference():
    rng = random.Random(0)
    for _ in range(12):
        L = rng.randint(2, 7)
        layer = LayerCosts(
            saved_bytes=1000,
            offloaded_bytes=rng.choice([300, 800, 950]),
            kept_bytes=50,
            forward_s=rng.random(),
            backward_s=2 * rng.random(),
            input_bytes=100,
            input_offloaded_bytes=rng.choice([0, 100]),
            gradient_bytes=rng.choice([0, 400, 2000]),
        )
        codes = policy_family(L)
        slice_bytes = rng.choice([None, 100, 250, 1000])
        d2h, h2d = rng.choice([100, 1e3, 1e4]), rng.choice([100, 1e3, 1e4])
        on_demand = rng.choice([(), (0,), (0, 1)])  # NOTE [Slices at the peak]
        many = simulate_many(codes, layer, d2h, h2d, slice_bytes, on_demand)
        for index, row in enumerate(codes):
            policy = [POLICY_CHOICES[code] for code in row]
            one = simulate_policy(
                policy, layer, d2h, h2d, reload_slice_bytes=slice_bytes, on_demand=on_demand
            )
            assert one.peak_bytes == many.peak_bytes[index], (policy, slice_bytes)
            assert one.end_of_forward_bytes == many.end_of_forward_bytes[index]
            assert one.step_s == pytest.approx(float(many.step_s[index]), rel=1e-12)


def test_the_plan_reloads_in_slices_only_where_the_budget_needs_it():
    """A loose budget: whole layers, as without slices.  With gradients counted as
    backward allocates them, the least peak of whole layers is in backward; a budget
    under it only slices reach: the plan reloads in slices, predicted under it, and
    says so."""
    layer = make_layer(saved=64 * MIB, offloaded=60 * MIB, kept=4 * MIB)
    plan = functools.partial(choose_policy, layer, 8, "h100", gradient_bytes=32 * MIB)
    loose = plan(memory_budget=2**40, reload_slice_bytes=MIB)
    assert loose.reload_slice_bytes is None and loose.policy == [KEEP] * 8
    budget = plan(memory_budget=0).predicted.peak_bytes - 1  # below what whole layers reach
    assert not plan(memory_budget=budget).fits
    sliced = plan(memory_budget=budget, reload_slice_bytes=MIB)
    assert sliced.fits and sliced.reload_slice_bytes == MIB
    assert sliced.predicted.peak_bytes <= budget and OFFLOAD in sliced.policy
    assert "reloaded in slices of 1.00 MiB" in sliced.line()


def test_the_plan_brings_layer_0_on_demand_where_only_that_fits():
    """NOTE [Slices at the peak]: with gradients counted, the least peak of slices
    prefetched one ahead is in layer 0's backward; a budget a byte under it is reached
    with layer 0's slices on demand (one slice held there, not two), and the plan says
    so; a budget the prefetch fits keeps it (no layer on demand)."""
    layer = make_layer(saved=64 * MIB, offloaded=60 * MIB, kept=4 * MIB)
    grads, slices = 16 * MIB, 16 * MIB
    prefetched = PolicySearch(layer, 8, "h100", slices, grads).choose(0)
    assert max(prefetched.predicted.log, key=lambda step: step[2])[0] == "bwd 0"
    budget = prefetched.predicted.peak_bytes - 1
    plan = functools.partial(
        choose_policy, layer, 8, "h100", reload_slice_bytes=slices, gradient_bytes=grads
    )
    on_demand = plan(memory_budget=budget)
    assert on_demand.fits and on_demand.predicted.peak_bytes <= budget
    assert on_demand.reload_on_demand_layers == (0,) and on_demand.policy[0] == OFFLOAD
    assert "layer 0 on demand" in on_demand.line()
    assert plan(memory_budget=budget + 1).reload_on_demand_layers == ()


def test_a_search_with_gradients_predicts_them():
    layer = make_layer(saved=64 * MIB, offloaded=60 * MIB, kept=4 * MIB)
    plain = PolicySearch(layer, 4, "h100")
    counted = PolicySearch(layer, 4, "h100", gradient_bytes=8 * MIB)
    keep = POLICY_CHOICES.index(KEEP)
    at = [i for i, row in enumerate(plain.codes) if (row == keep).all()][0]
    assert counted.results.peak_bytes[at] == plain.results.peak_bytes[at]  # at the forward's end
    assert counted.costs[0].gradient_bytes == 8 * MIB


def test_the_pops_of_a_census_issue_and_wait_as_the_engine_does():
    """Four storages in pack order (bytes, backward seconds before the first unpack,
    rank); slices of 100 in reverse pack order: [d], [c], [b, a].  The backward takes
    from slice 0 at once, from slice 2 at 1 s (out of order: issued then, behind slice
    1, which slice 0's pop issued), from slice 1 at 1.5 s; 3 s of compute."""
    layer = replace(
        costs(),
        offloaded_bytes=400,
        unpacks=((50, 2.0, 3), (50, 1.0, 1), (100, 1.5, 2), (200, 0.0, 0)),
        backward_s=3.0,
    )
    sizes, pops = layer.slices(100)
    assert sizes == [200, 100, 100]
    assert [(p.after, p.issues, p.wait) for p in pops] == [
        (0.0, (1,), 0),
        (1.0, (2,), 2),
        (0.5, (), 1),
        (1.5, (), -1),
    ]
    # 100 bytes a second: slice 1 is there at 1 s, slice 2 at 2 s (queued behind it)
    compute, copies, waited = sliced_backward(0.0, 0.0, sizes, pops, 100.0)
    assert (compute, copies, waited) == (4.0, 2.0, 1.0)  # 3 s of compute, 1 s waited
    policy = [OFFLOAD, KEEP]
    many = simulate_many(
        np.array([[POLICY_CHOICES.index(c) for c in policy]]), layer, 1e6, 100.0, 100
    )
    one = simulate_policy(policy, layer, 1e6, 100.0, reload_slice_bytes=100)
    assert one.step_s == pytest.approx(float(many.step_s[0]), rel=1e-12)
    assert one.peak_bytes == many.peak_bytes[0]
