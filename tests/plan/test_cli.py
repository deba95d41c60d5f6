"""python -m cpu_offload.plan: the table, the JSON, the answers, the errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hosts import require

from cpu_offload.engine.host_buffers import pool_reserve
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
    assert "smallest k that fits 0.0500 GiB of activations: 2" in out
    plan = json.loads(path.read_text())
    assert plan["predicted"] is True and plan["num_layers"] == 4
    assert [row["k"] for row in plan["rows"]] == [0, 1, 2, 3]
    assert plan["layer"]["attention"] == "cpu"
    assert plan["smallest_fitting_k"] == 2


def test_a_budget_no_k_fits_gets_a_policy_with_checkpointing(capsys):
    assert main(["--preset", "tiny", "--memory-budget", "0.0215"]) == 0
    out = capsys.readouterr().out
    assert "no k fits 0.0215 GiB of activations: offloading alone is not enough" in out
    assert "policy for 0.0215 GiB (the fastest of" in out
    assert "checkpoint" in out.split("policy for")[1]


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


LLAMA_8B_CONFIG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
}


def without_transformers(monkeypatch):
    """The planner as it runs where transformers is not installed."""
    import importlib.util

    import cpu_offload.plan.layers as layers

    real = importlib.util.find_spec
    monkeypatch.setattr(
        layers.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )


@pytest.fixture(name="without_transformers")
def without_transformers_fixture(monkeypatch):
    without_transformers(monkeypatch)


def test_a_llama_config_json_is_read_without_transformers(tmp_path, monkeypatch):
    """The same plan with and without transformers (tests/plan/test_hf_llama.py compares
    the layers tensor for tensor)."""
    require("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_8B_CONFIG))
    theirs, ours = tmp_path / "with.json", tmp_path / "without.json"
    common = ["--hf-config", str(tmp_path), "--seq", "2048", "--batch", "1", "--json"]
    assert main([*common, str(theirs)]) == 0
    without_transformers(monkeypatch)
    assert main([*common, str(ours)]) == 0
    hf, fallback = json.loads(theirs.read_text()), json.loads(ours.read_text())
    assert "read without transformers" in fallback["description"]
    assert fallback["num_layers"] == hf["num_layers"] == 32
    assert fallback["layer"].pop("description") != hf["layer"].pop("description")
    assert fallback["layer"] == hf["layer"] and fallback["layer"]["offloaded_bytes"] > 0
    # Bytes exactly; times within 2% of the step: transformers' layer also appends to its
    # cache, a few memory-bound kernels the fallback does not run.
    for mine, its in zip(fallback["rows"], hf["rows"], strict=True):
        for key, value in its.items():
            if key.endswith("_s"):
                assert mine[key] == pytest.approx(value, abs=0.02 * its["step_s"]), key
            elif key == "overhead":
                assert mine[key] == pytest.approx(value, abs=0.02), key
            else:
                assert mine[key] == value, key
    assert [r["host_bytes_per_rank"] for r in hf["rows"]] == [
        pool_reserve(r["offloaded_bytes"]) for r in hf["rows"]
    ]


def test_another_model_type_without_transformers_says_what_to_install(
    tmp_path, without_transformers, capsys
):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_8B_CONFIG, "model_type": "gpt2"}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf-config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model_type 'gpt2' needs transformers to build its layer (pip install" in err


def test_a_model_name_without_transformers_says_what_to_install(without_transformers, capsys):
    with pytest.raises(SystemExit):
        main(["--hf-config", "meta-llama/Meta-Llama-3-8B"])
    assert "which needs transformers (pip install transformers)" in capsys.readouterr().err


def test_the_table_says_how_much_host_memory_a_rank_needs(capsys):
    assert main(["--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "host GiB/rank" in out and "cap it with max_host_bytes" in out


def test_every_flag_of_help_says_what_it_does_and_its_default():
    """Issue 49, item 8: ``plan --help`` gives every flag a text and its default, and
    says which seq ``--hf-config`` plans by default."""
    from cpu_offload.plan.__main__ import parser

    result = subprocess.run(
        [sys.executable, "-m", "cpu_offload.plan", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())  # argparse wraps lines
    flags = [a for a in parser()._actions if a.option_strings != ["-h", "--help"]]
    assert len(flags) == 26
    for action in flags:
        assert action.help and "default" in action.help, action.option_strings
        assert " ".join(action.help.replace("%%", "%").split()) in text, action.help
    hf_config = next(a for a in flags if "--hf-config" in a.option_strings)
    assert "seq 4096 and batch 1 unless --seq and --batch say otherwise" in hf_config.help
    assert "The layer is --preset llama8b-layer unless" in text
