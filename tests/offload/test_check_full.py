"""``python -m cpu_offload.check --full --simulate h100`` (NOTE [The first hour on a GPU]):
the command that runs first on a GPU, run in CI on the modeled device."""

from __future__ import annotations

import json

import pytest

from cpu_offload import check, check_full

SIMULATED = {
    "llama8b-layer benchmark",
    "peers' rows",
    "sliced reloads, on-demand layers and per-tensor release (peak and step)",
    "keep_passes and ZB-V, 2-rank pipeline",
    "32 x 8k at k = 24",
    "host pool vs host_memory_stats()",
    "compile: fullgraph blocks",
    "cuda_graph: a captured step",
    "cuda_graph review (a)-(e)",
}


def test_full_simulated_runs_every_row_it_can_and_says_what_the_others_need(tmp_path, capsys):
    path = tmp_path / "full.json"
    assert check.main(["--full", "--simulate", "h100", "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    assert document["environment"]["simulate"] == "h100"
    rows = document["checks"]
    names = ["device checks"] + [name for name, _, _ in check_full.CHECKS]
    assert [row["name"] for row in rows] == names
    for row in rows:
        assert row["status"] == ("PASS" if row["name"] in SIMULATED else "NOT RUN"), row
        assert row["figure"] and row["needs"]
    by_name = {row["name"]: row for row in rows}
    assert "agreement over" in by_name["32 x 8k at k = 24"]["figure"]
    assert "torchtune: peer/ours" in by_name["peers' rows"]["figure"]
    assert by_name["pinned rounding vs host_memory_stats()"]["figure"] == (
        "modeled: 600 MiB pinned holds 1024 MiB"
    )
    reloads = by_name["sliced reloads, on-demand layers and per-tensor release (peak and step)"]
    assert reloads["figure"].startswith("k=6 of 8 at 8k, peak and step: plain: ")
    assert "layer 0 on demand: " in reloads["figure"]
    assert "torch 448.0 MiB" in by_name["host pool vs host_memory_stats()"]["figure"]
    assert "bit-identical" in by_name["compile: fullgraph blocks"]["figure"]
    graphed = by_name["cuda_graph: a captured step"]["figure"]
    assert "each of 3 replays moved 288.0 MiB out" in graphed
    reviewed = by_name["cuda_graph review (a)-(e)"]["figure"]
    assert [part[:10] for part in reviewed.split("; ")] == [
        "(a) PASS: ",
        "(b) PASS: ",
        "(c) PASS: ",
        "(d) PASS: ",
        "(e) NOT RU",
    ], reviewed
    out = capsys.readouterr().out
    assert "| check (modeled h100) | status | figure | needs |" in out
    assert out.count("| PASS |") == len(SIMULATED)


def test_a_row_that_fails_or_raises_is_a_fail_and_the_exit_status_says_so(monkeypatch, capsys):
    def broken(device, simulate):
        raise RuntimeError("no such device")

    checks = [("broken", "nothing", broken), ("fine", "nothing", lambda d, s: ("PASS", "1"))]
    monkeypatch.setattr(check_full, "CHECKS", checks)
    assert check.main(["--full", "--simulate", "h100"]) == 1
    out = capsys.readouterr().out
    assert "| device checks | NOT RUN |" in out
    assert "| broken | FAIL | RuntimeError: no such device | nothing |" in out
    assert "| fine | PASS | 1 | nothing |" in out


def test_simulate_goes_with_full(capsys):
    with pytest.raises(SystemExit) as exited:
        check.main(["--simulate", "h100"])
    assert exited.value.code == 2
    assert "--simulate PROFILE: goes with --full" in capsys.readouterr().err


def test_a_benchmark_measured_on_the_device_shows_each_modes_step_and_peak():
    """On a device the benchmark's JSON has its modes, not the model's agreement: the row
    shows each mode's median step and peak, and why a mode was skipped."""
    rows = [
        {"mode": "none", "skipped": None, "median_step_ms": 100.54, "peak_bytes": 3 * 2**30},
        {"mode": "trl", "skipped": "trl is not importable", "median_step_ms": None},
        {"mode": "checkpoint", "skipped": None, "median_step_ms": 18.3, "peak_bytes": None},
    ]
    assert [check_full._measured_mode(row) for row in rows] == [
        "none: 100.5 ms, peak 3.00 GiB",
        "trl: skipped (trl is not importable)",
        "checkpoint: 18.3 ms",
    ]
