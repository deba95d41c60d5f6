"""python -m cpu_offload.plan: the table, the JSON, the answers, the errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cpu_offload.plan.__main__ import main


def test_tiny_preset_table_and_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code = main(
        ["--preset", "tiny", "--attention", "cpu", "--device", "a100", "--json", str(path),
         "--memory-budget", "0.05"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "times are PREDICTED" in out and "A100 SXM" in out
    assert "smallest k that fits 0.05 GiB of activations: 2" in out
    plan = json.loads(path.read_text())
    assert plan["predicted"] is True and plan["num_layers"] == 4
    assert [row["k"] for row in plan["rows"]] == [0, 1, 2, 3]
    assert plan["layer"]["attention"] == "cpu"
    assert plan["smallest_fitting_k"] == 2


def test_a_budget_nothing_fits_says_to_checkpoint(capsys):
    assert main(["--preset", "tiny", "--memory-budget", "0.001"]) == 0
    assert "offloading alone is not enough; checkpoint" in capsys.readouterr().out


def test_unknown_device_is_an_error_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--device", "tpu"])
    assert exit_info.value.code == 2
    assert "unknown device profile 'tpu': use one of h100, h200" in capsys.readouterr().err


def test_the_module_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cpu_offload.plan", "--gpt", "--hidden", "1024", "--heads", "16",
         "--seq", "1024", "--layers", "4", "--device", "gh200"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "GPT layer (Korthikanti et al.)" in result.stdout
    assert "largest k within 2.0% overhead" in result.stdout


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the bench extra; .ci/run installs it
    path = tmp_path / "plan.png"
    assert main(["--preset", "tiny", "--plot", str(path)]) == 0
    assert f"plot written to {path}" in capsys.readouterr().out
    assert path.stat().st_size > 1000
