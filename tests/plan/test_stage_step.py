"""A memory budget inside a pipeline stage takes its step from the stage model (NOTE [A
budget inside a stage] in plan/stage_plan.py): per-layer policies with checkpointing
through ``simulate_stage``, the plan's step the stage model's, the fastest that fits by
it, and its prediction against the offload code on the modeled accelerator."""

from __future__ import annotations

import dataclasses

import pytest

from cpu_offload.plan.pipeline import StagePolicy, gradient_accumulation_s, simulate_stage
from cpu_offload.plan.policy_search import PolicySearch
from cpu_offload.plan.schedule_model import LayerCosts, first_k
from cpu_offload.plan.stage_plan import choose_for_stage, fifo_order, stage_rows, stage_step

MiB = 2**20
#: 64 MiB saved (60 offloadable), 8 MiB of inputs (6 offloadable), 4/8 ms, 3 ms recompute
LAYER = LayerCosts(64 * MiB, 60 * MiB, 4 * MiB, 4e-3, 8e-3, 8 * MiB, 6 * MiB, recompute_s=3e-3)


@pytest.mark.parametrize(("link", "below"), [(50e9, 0.02), (5e9, 0.17)])
def test_policies_with_checkpointing_run_through_the_stage_model(link, below):
    """Every candidate of the search over 4 layers (offload, checkpoint, checkpoint+offload
    and keep blocks), 3 passes in flight: every pass kept, the stage model's step per
    pass is the event model's of one pass (GPipe's passes do not share the link) and its
    peak the closed form's; with passes moved whole, the same peak, and the closed form
    that ranks them never above the stage model's step, and below it by at most 2% at 50
    GB/s and 17% at 5 GB/s (16.3%, one pass kept: it leaves out that the moved passes'
    reloads queue on the link they share)."""
    n = 3
    search = PolicySearch.of_layers([LAYER] * 4, link, link)
    rows, keeps, peaks, steps, _ = stage_rows(search, n)
    assert search.checkpoints.max() > 0  # checkpointed layers among the candidates
    for i, (row, keep) in enumerate(zip(rows, keeps, strict=True)):
        run = stage_step(search, search.codes[row], int(keep), n)
        assert run.peak_bytes == peaks[i], (search.codes[row], keep)
        if keep == 0:
            assert run.step_s / n == pytest.approx(search.results.step_s[row], rel=1e-9)
        else:
            per_pass = run.step_s / n
            assert (1 - below) * per_pass <= steps[i] <= per_pass * (1 + 1e-9)


def test_a_checkpointed_layer_is_recomputed_in_every_pass():
    """One pass in flight kept, one moved whole: the stage model's step with the whole
    stack checkpointed is the step without offload plus each pass's recompute, on a link
    too fast to expose a copy."""
    layers = ("checkpoint",) * 4
    order = fifo_order(2)
    ready = [0.0] * len(order)
    plain = simulate_stage(order, ready, LAYER, 4, StagePolicy(0, 1), 1e15, 1e15)
    checkpointed = simulate_stage(order, ready, LAYER, 4, StagePolicy(0, 1, layers), 1e15, 1e15)
    assert checkpointed.step_s == pytest.approx(plain.step_s + 2 * 4 * 3e-3, abs=1e-6)
    assert checkpointed.peak_bytes < plain.peak_bytes  # the passes keep their inputs only
    words = StagePolicy(0, 1, layers).words(4, 2)
    assert words == "layers 0-3 checkpoint; keep 1 pass, 1 of 2 moved whole"


@pytest.mark.parametrize("link", [50e9, 5e9])
def test_the_plan_is_the_fastest_by_the_stage_model_that_fits(link):
    """Four passes in flight of 4 layers that cannot be checkpointed: for budgets from the
    smallest stage to the whole, the plan's step is the stage model's for it, and no
    first-k policy and ``keep_passes`` that fits is faster by the stage model."""
    n, layers = 4, 4
    search = PolicySearch.of_layers([LAYER] * layers, link, link, hazards=[["no"]] * layers)
    order = fifo_order(n)
    runs = {
        (k, keep): simulate_stage(
            order, [0.0] * len(order), LAYER, layers, StagePolicy(k, keep), link, link
        )
        for k in range(layers)
        for keep in (None, *range(1, n))
    }
    smallest = min(r.peak_bytes for r in runs.values())
    for budget in range(smallest, 4 * 64 * MiB + 1, 16 * MiB):
        plan = choose_for_stage(search, budget, None, n)
        assert plan.fits
        k = plan.policy.count("offload")
        assert plan.policy == first_k(layers, k)
        chosen = runs[(k, plan.keep_passes)]
        assert plan.predicted.step_s == pytest.approx(chosen.step_s / n, rel=1e-12)
        assert plan.predicted.peak_bytes == chosen.peak_bytes <= budget
        fastest = min(r.step_s for r in runs.values() if r.peak_bytes <= budget)
        assert chosen.step_s == pytest.approx(fastest, rel=1e-12), budget


def test_the_plan_inside_a_stage_agrees_with_the_modeled_accelerator():
    """GPipe's four passes of four Llama-3-8B layers (seq 1024) on a modeled GH200 whose
    link runs at 50 GB/s, 0.8 GiB: the plan moves passes whole, and its step (per pass;
    the three gradient accumulations added, the same for every plan) is the offload
    code's on the modeled device within 3% (136.7 ms predicted, 134.4 modeled), its peak
    within 2%.  (The closed form it took before, the per-layer policy's step plus a moved
    pass's exposure, predicted 149.7 ms: a pass moved whole does not run the per-layer
    offloads.)"""
    from cpu_offload.bench.config import parse_args
    from cpu_offload.bench.pipeline import modeled_stage
    from cpu_offload.bench.simulate import stack_of
    from cpu_offload.device.profiles import get_profile

    config = parse_args(["--preset", "llama8b-layer", "--layers", "4", "--seq", "1024"])
    stack, x, layer = stack_of(config)
    device = dataclasses.replace(get_profile("gh200"), link_bytes_per_s=50e9, h2d_bytes_per_s=50e9)
    costs = LayerCosts.of(layer, device).per_layer(4)
    search = PolicySearch.of_layers(costs, 50e9, 50e9, hazards=[["no"]] * 4)
    n = 4
    plan = choose_for_stage(search, int(0.8 * 2**30), None, n)
    assert plan.fits and plan.keep_passes is not None
    order = fifo_order(n)
    run, _ = modeled_stage(
        [stack], x, device, order, [0.0] * len(order), k=plan.policy.count("offload"),
        keep_passes=plan.keep_passes, min_offload_numel=config.min_offload_numel, record=False,
    )  # fmt: skip
    accumulate = (n - 1) * gradient_accumulation_s(stack, device)
    assert run.step_s == pytest.approx(n * plan.predicted.step_s + accumulate, rel=0.03)
    assert run.counted_peak_bytes == pytest.approx(plan.predicted.peak_bytes, rel=0.02)
    assert run.counted_peak_bytes <= 0.8 * 2**30
