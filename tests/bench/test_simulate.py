"""``python -m cpu_offload.bench --simulate``: the real offload code on a modeled device,
beside the planner, at a size CI runs in seconds."""

from __future__ import annotations

import importlib.util
import json

import pytest

from cpu_offload.bench import main
from cpu_offload.bench.config import parse_args
from cpu_offload.bench.simulate import run_simulation
from cpu_offload.bench.simulate_report import agreement

FIELDS = {
    "k",
    "policy",
    "modeled_step_s",
    "predicted_step_s",
    "modeled_peak_bytes",
    "predicted_peak_bytes",
    "modeled_exposed_copy_s",
    "predicted_exposed_copy_s",
}


def test_the_tiny_preset_modeled_every_k_and_a_budget(tmp_path, capsys):
    paths = {name: tmp_path / name for name in ("sim.json", "trace.json", "sim.png")}
    argv = ["--preset", "tiny", "--simulate", "h100", "--memory-budget", "0.05"]
    argv += ["--json", str(paths["sim.json"]), "--trace", str(paths["trace.json"])]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(paths["sim.png"])]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "agreement over 5 rows" in out and "0.05 GiB: " in out
    document = json.loads(paths["sim.json"].read_text())
    rows = document["simulated"]
    assert [row["k"] for row in rows[:4]] == [0, 1, 2, 3]
    assert all(FIELDS <= set(row) for row in rows)
    assert rows[0]["policy"] is None and len(rows[4]["policy"]) == 4
    assert rows[3]["modeled_exposed_copy_s"] > 0 and rows[0]["modeled_exposed_copy_s"] == 0
    for row in rows:  # the same bytes saved, whatever the times
        assert row["modeled_peak_bytes"] == pytest.approx(row["predicted_peak_bytes"], rel=0.02)
    assert document["profile"]["name"] == "H100 SXM"
    trace = json.loads(paths["trace.json"].read_text())
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert processes[:2] == ["k=0", "k=1"] and len(processes) == 5
    assert any(e["ph"] == "C" for e in trace["traceEvents"])  # device memory
    if "--plot" in argv:
        assert paths["sim.png"].stat().st_size > 10_000


@pytest.mark.parametrize("profile", ["h100", "910b"])
def test_the_code_and_the_planner_agree_where_compute_binds(profile):
    """Llama-3-8B layers, fewer and shorter: the model of the code and the planner meet
    within 3% of the step and 2% of the peak for every k and two budgets' policies."""
    config = parse_args(
        ["--preset", "llama8b-layer", "--layers", "6", "--seq", "1024", "--simulate", profile]
    )
    simulation = run_simulation(config, profile, config.offload, (0.4, 0.8))
    assert [row.k for row in simulation.rows[:6]] == list(range(6))
    worst = agreement(simulation)
    assert abs(worst["worst_step_difference"]) < 0.03, worst
    assert abs(worst["worst_peak_difference"]) < 0.02, worst
    assert abs(worst["worst_end_of_forward_difference"]) < 0.02, worst
    exposed = [row.modeled.exposed_copy_s for row in simulation.rows]
    assert exposed[5] > 0  # k = L - 1 cannot hide its copies
