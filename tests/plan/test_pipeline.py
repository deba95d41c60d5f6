"""The plan per pipeline stage: torch's schedule orders, passes in flight, the stage model
and ``python -m cpu_offload.plan --pipeline-stages``."""

from __future__ import annotations

import json

import pytest

from cpu_offload.plan.__main__ import main
from cpu_offload.plan.pipeline import (
    StagePolicy,
    arrivals,
    candidates,
    in_flight,
    plan_pipeline,
    rank_orders,
    simulate_stage,
)
from cpu_offload.plan.schedule_model import LayerCosts

GIB = 2**30
FIELDS = {
    "stage",
    "in_flight",
    "policy",
    "keep_passes",
    "layer_policy",
    "predicted_peak_bytes",
    "predicted_offloaded_bytes",
    "predicted_step_s",
    "fits",
}


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches", "expected"),
    [
        ("1f1b", 4, 8, [4, 3, 2, 1]),
        ("1f1b", 4, 2, [2, 2, 2, 1]),
        ("gpipe", 4, 8, [8, 8, 8, 8]),
        ("zbv", 4, 8, [8, 7, 6, 5]),
        ("interleaved", 2, 4, [4, 3]),
    ],
    ids=str,
)
def test_passes_in_flight_from_torchs_schedules(schedule, ranks, microbatches, expected):
    orders = rank_orders(schedule, ranks, microbatches)
    assert [in_flight(order) for order in orders] == expected
    for order in orders:  # every micro-batch forward and backward once per stage
        stages = {a.stage for a in order}
        forwards = sorted((a.stage, a.microbatch) for a in order if a.kind == "F")
        assert forwards == [(s, m) for s in sorted(stages) for m in range(microbatches)]


def test_the_1f1b_order_is_the_one_torch_runs():
    """Schedule1F1B._step_microbatches: P - rank forwards, then a backward and a forward."""
    first, *_, last = rank_orders("1f1b", 3, 4)
    words = [f"{a.kind}{a.microbatch}" for a in first]
    assert words == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [f"{a.kind}{a.microbatch}" for a in last] == ["F0", "B0", "F1", "B1"] + [
        "F2",
        "B2",
        "F3",
        "B3",
    ]


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule 'dualpipe'"):
        rank_orders("dualpipe", 2, 4)


def test_arrivals_follow_the_neighbours():
    """Two ranks, one micro-batch: F at stage 1 after F at stage 0 (1 s), B at stage 0
    after B at stage 1 (1 + 1 + 2 s)."""
    orders = rank_orders("1f1b", 2, 1)
    assert arrivals(orders, 1.0, 2.0) == [[0.0, 4.0], [1.0, 2.0]]


def _costs(saved: int = 100, forward_s: float = 1.0) -> LayerCosts:
    return LayerCosts(saved, saved, 0, forward_s, 2 * forward_s)


def test_without_offload_a_stage_holds_every_pass_in_flight():
    orders = rank_orders("gpipe", 2, 3)
    ready = arrivals(orders, 2.0, 4.0)
    row = simulate_stage(orders[0], ready[0], _costs(), 2, StagePolicy(0), 1e9, 1e9)
    assert row.peak_bytes == 3 * 2 * 100 and row.offloaded_bytes == 0
    assert row.exposed_copy_s == 0 and row.passes_moved_whole == 0


def test_passes_moved_whole_leave_the_device_and_come_back():
    """GPipe, six passes of two layers, a fast link: offloading the first layer of every
    pass leaves six layers on the device; keeping one pass and moving the other five
    whole leaves the pass in backward and the last layer of the one coming back (the
    others follow it layer by layer in its backward), where a pass brought back at once
    would be whole."""
    orders = rank_orders("gpipe", 2, 6)
    ready = arrivals(orders, 2.0, 4.0)
    kept = simulate_stage(orders[0], ready[0], _costs(), 2, StagePolicy(0, 1), 1e6, 1e6)
    per_layer = simulate_stage(orders[0], ready[0], _costs(), 2, StagePolicy(1), 1e6, 1e6)
    assert kept.passes_moved_whole == 5
    assert kept.offloaded_bytes == 5 * 2 * 100  # five passes, both layers each
    assert per_layer.offloaded_bytes == 6 * 100  # the first layer of each pass
    assert kept.peak_bytes == 3 * 100 < per_layer.peak_bytes == 6 * 100
    # its copies hid behind the other passes but the last layer's, at each forward's end
    assert kept.exposed_copy_s == pytest.approx(5 * 100 / 1e6)
    assert kept.step_s == ready[0][-1] + 2 * 2.0  # the last backward, on time


def test_a_slow_link_makes_passes_moved_whole_wait_for_their_copies():
    """Each layer's release waits for its copy (NOTE [Moving a pass whole]): a link too
    slow for the copies costs time, not memory."""
    orders = rank_orders("gpipe", 2, 6)
    ready = arrivals(orders, 2.0, 4.0)
    slow = simulate_stage(orders[0], ready[0], _costs(), 2, StagePolicy(0, 1), 1.0, 1.0)
    fast = simulate_stage(orders[0], ready[0], _costs(), 2, StagePolicy(0, 1), 1e6, 1e6)
    assert slow.peak_bytes == fast.peak_bytes == 3 * 100
    assert slow.exposed_copy_s > 10 * 100 and slow.step_s > fast.step_s + 10 * 100


def test_the_candidates_of_a_stage():
    found = candidates(3, 3)
    assert StagePolicy(2) in found and StagePolicy(0, 2) in found
    assert StagePolicy(0, 3) not in found and len(found) == 3 * 3


def test_a_tight_budget_moves_passes_whole_where_layers_cannot_fit():
    """GPipe keeps 8 passes of 2 layers: offloading a layer of each leaves 8 layers on
    the device; keeping 2 passes and moving the rest whole leaves about 4."""
    plan = plan_pipeline(
        _costs(GIB, 0.01), 4, 1e12, 1e12, ranks=2, microbatches=8, schedule="gpipe",
        memory_budget=6 * GIB,
    )  # fmt: skip
    stage = plan.stages[0]
    assert stage.in_flight == 8 and stage.fits
    assert stage.policy.keep_passes is not None
    assert stage.layer_k.peak_bytes > 6 * GIB  # today's layer-k cannot
    entry = stage.to_json()
    assert FIELDS <= set(entry) and entry["keep_passes"] == stage.policy.keep_passes
    assert entry["policy"].endswith("of 8 moved whole")


def test_the_policy_in_words():
    assert StagePolicy(2).words(4) == "layers 0-1 offload, 2-3 keep"
    words = "layers 0 offload, 1 keep; keep 1 pass, 3 of 4 moved whole"
    assert StagePolicy(1, 1).words(2, 4) == words


def test_the_command_plans_every_stage(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["--preset", "tiny", "--pipeline-stages", "2", "--microbatches", "4"]
    assert main([*argv, "--memory-budget", "0.05", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 1f1b, 2 ranks x 1 stage(s) of 2 layers, 4 micro-batches" in out
    document = json.loads(path.read_text())
    stages = document["stages"]
    assert [s["stage"] for s in stages] == [0, 1] and [s["in_flight"] for s in stages] == [2, 1]
    assert all(FIELDS <= set(s) for s in stages)
    assert all(s["predicted_peak_bytes"] <= 0.05 * GIB and s["fits"] for s in stages)
    assert stages[0]["without_offload"]["peak_bytes"] > 0.05 * GIB
    assert document["num_layers"] == 2  # the every-k table: one stage's layers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--microbatches", "4"], "--microbatches 4: plans a pipeline; pass --pipeline-stages"),
        (["--pipeline-stages", "2"], "--pipeline-stages: expected --microbatches M"),
        (
            ["--pipeline-stages", "3", "--microbatches", "4"],
            "--layers 4: expected a multiple of the pipeline's 3 stages",
        ),
        (
            ["--pipeline-stages", "2", "--microbatches", "4", "--virtual-stages", "2"],
            "--virtual-stages 2: sets the stages per rank of --schedule interleaved",
        ),
    ],
    ids=["no-stages", "no-microbatches", "uneven", "virtual-without-interleaved"],
)
def test_pipeline_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--preset", "tiny", *argv])
    assert message in capsys.readouterr().err


def test_zbv_keeps_a_pass_until_its_weight_gradients():
    """ZB-V splits the backward: I (input gradients) and W (weight gradients, which read
    the layers' inputs). Without offload a rank holds every pass of both its stages from F
    to W, and I and W each take half the backward."""
    orders = rank_orders("zbv", 2, 4)
    assert {a.kind for a in orders[0]} == {"F", "I", "W"}
    ready = arrivals(orders, 2.0, 4.0)  # two layers of 1 s forward, 2 s backward
    for order, times in zip(orders, ready, strict=True):
        live = most = 0
        for action in order:
            live += {"F": 1, "W": -1}.get(action.kind, 0)
            most = max(most, live)
        row = simulate_stage(order, times, _costs(), 2, StagePolicy(0), 1e6, 1e6)
        assert row.peak_bytes == most * 2 * 100
        assert row.step_s == pytest.approx(row.waited_s + 2.0 * len(order))  # 2 s each


def test_zbv_weight_gradients_reload_what_the_pass_moved():
    """ZB-V's W reads the saved tensors again: the offloaded layer comes back a second
    time, its reload started as I ends, and W waits for it (NOTE [A backward in two
    phases] in engine/weight_pass.py). Two layers of 100 bytes, 1 s forward, 2 s
    backward, 100 B/s: F 0-3 (1 s waiting for layer 0's copy), I 3-6 (1 s waiting for
    its reload), W's reload 6-7, W 7-9."""
    from cpu_offload.plan.stage_plan import Action

    order = [Action(kind, 0, 0, 0) for kind in ("F", "I", "W")]
    row = simulate_stage(order, [0.0] * 3, _costs(), 2, StagePolicy(1), 100.0, 100.0)
    assert row.step_s == pytest.approx(9.0)
    assert row.exposed_copy_s == pytest.approx(3.0)
    assert row.offloaded_bytes == 100
    assert row.peak_bytes == 200  # layer 1 retained beside layer 0 reloaded
    # W a quarter of the backward: I 3-7 (1.5 s a layer), W's reload 7-8, W 8-9
    quarter = simulate_stage(order, [0.0] * 3, _costs(), 2, StagePolicy(1), 100, 100, 0.0, 0.25)
    assert quarter.step_s == pytest.approx(9.0) and quarter.exposed_copy_s == pytest.approx(3.0)
    fast = simulate_stage(order, [0.0] * 3, _costs(), 2, StagePolicy(1), 1e9, 1e9, 0.0, 0.25)
    assert fast.step_s == pytest.approx(2.0 + 3.0 + 1.0, abs=1e-3)  # the copies hidden


def test_the_planner_and_a_budget_inside_a_stage_share_one_model_of_its_peak():
    """GPipe's 8 passes of 2 layers of 4 MiB that nothing can shrink, every pass kept or
    one kept and 7 moved whole: the planner per stage (its rank's order) and a memory
    budget inside a stage (the passes in flight it measured) give the same peak, from
    the same walk (NOTE [A stage's passes in flight] in plan/pipeline/stage_model.py)."""
    from cpu_offload.plan.policy_search import PolicySearch
    from cpu_offload.plan.stage_plan import stage_rows
    from cpu_offload.policy.policy import POLICY_CHOICES

    mib = 2**20
    layer = LayerCosts(4 * mib, 4 * mib, 0, 1e-3, 2e-3)
    search = PolicySearch.of_layers([layer] * 2, 1e12, 1e12, hazards=[["no"]] * 2)
    rows, keeps, peaks, _, _ = stage_rows(search, 8)
    kept_all = [POLICY_CHOICES.index("keep")] * 2
    order = rank_orders("gpipe", 2, 8)[0]
    ready = arrivals(rank_orders("gpipe", 2, 8), 2e-3, 4e-3)[0]
    for keep, expected in ((None, 8 * 8 * mib), (1, 3 * 4 * mib)):
        planner = simulate_stage(order, ready, layer, 2, StagePolicy(0, keep), 1e12, 1e12)
        inside = [
            int(p)
            for r, k, p in zip(rows, keeps, peaks, strict=True)
            if list(search.codes[r]) == kept_all and k == (keep or 0)
        ]
        assert planner.peak_bytes == inside[0] == expected


def test_the_stage_model_gives_the_stage_memory_over_time():
    """GPipe's 4 passes of 2 layers of 4 MiB on one stage: without offload each pass
    holds 8 MiB from its forward to its backward, so the stage's memory rises by 8 MiB a
    forward and falls by as much a backward; its peak is the largest.  With one pass
    kept the others are moved whole and the stage holds less, by the same walk."""
    mib = 2**20
    layer = LayerCosts(4 * mib, 4 * mib, 0, 1e-3, 2e-3)
    order = rank_orders("gpipe", 1, 4)[0]
    ready = [0.0] * len(order)
    kept = simulate_stage(order, ready, layer, 2, StagePolicy(0), 1e12, 1e12)
    assert [a.kind for a in order] == ["F"] * 4 + ["B"] * 4
    assert [held // mib for held in kept.held_bytes] == [8, 16, 24, 32, 32, 24, 16, 8]
    assert kept.peak_bytes == max(kept.held_bytes) == 32 * mib
    moved = simulate_stage(order, ready, layer, 2, StagePolicy(0, 1), 1e12, 1e12)
    assert len(moved.held_bytes) == len(order)
    assert moved.peak_bytes == max(moved.held_bytes) < kept.peak_bytes
    assert all(m <= k for m, k in zip(moved.held_bytes, kept.held_bytes, strict=True))


@pytest.mark.parametrize("link", [1e12, 50e9, 5e9])
def test_a_budget_inside_a_stage_and_the_stage_model_agree(link):
    """Four passes in flight of 4 layers (64 MiB saved, 60 offloadable, 4/8 ms), every
    first-k policy and ``keep_passes``: a budget inside a stage times a candidate by the
    stage model (``stage_step``: ``simulate_stage`` on GPipe's order), so both give the
    same peak and step.  The closed form that ranks the candidates (``stage_rows``) is
    the stage model's step where every pass is kept; with passes moved whole it leaves
    out the link they share, so it is below it, by at most 11% on these links (10.3% at
    5 GB/s with one pass kept: three passes' reloads queue on the link)."""
    from cpu_offload.plan.policy_search import PolicySearch
    from cpu_offload.plan.schedule_model import first_k
    from cpu_offload.plan.stage_plan import fifo_order, stage_rows, stage_step
    from cpu_offload.policy.policy import POLICY_CHOICES

    mib, layers, n = 2**20, 4, 4
    layer = LayerCosts(64 * mib, 60 * mib, 4 * mib, 4e-3, 8e-3)
    search = PolicySearch.of_layers([layer] * layers, link, link, hazards=[["no"]] * layers)
    rows, keeps, peaks, steps, _ = stage_rows(search, n)
    order = fifo_order(n)
    for k in range(layers):
        codes = [POLICY_CHOICES.index(choice) for choice in first_k(layers, k)]
        for keep in range(n):
            (i,) = [
                i
                for i, (r, kept) in enumerate(zip(rows, keeps, strict=True))
                if list(search.codes[r]) == codes and kept == keep
            ]
            policy = StagePolicy(k, keep or None)
            model = simulate_stage(order, [0.0] * len(order), layer, layers, policy, link, link)
            assert int(peaks[i]) == model.peak_bytes, (k, keep)
            inside = stage_step(search, search.codes[rows[i]], keep, n)
            assert (inside.step_s, inside.peak_bytes) == (model.step_s, model.peak_bytes)
            per_pass = model.step_s / n
            if keep == 0:
                assert steps[i] == pytest.approx(per_pass, rel=1e-9), k
            else:
                assert 0.89 * per_pass <= steps[i] <= per_pass * (1 + 1e-9), (k, keep)
