"""``python -m cpu_offload.plan --hf-config``, run as a user runs it: a pipeline of a
Hugging Face config's layers (issue 49, item 1), and recommendations under a host cap
(issue 49, item 3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hosts import require

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "vocab_size": 128}


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpu_offload.plan", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_pipeline_of_a_hugging_face_config_writes_its_plan(tmp_path, model_type):
    """The layer of ``--hf-config`` is a module already (taken from its model), not a
    function that builds one: the stages' gradient accumulation measures it as it is."""
    require("transformers")
    config = tmp_path / "config.json"
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    config.write_text(json.dumps({"model_type": model_type, **SMALL, **heads}))
    out = tmp_path / "plan.json"
    result = plan(
        "--hf-config", str(config), "--seq", "64", "--pipeline-stages", "4",
        "--microbatches", "8", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pipeline: 1f1b, 4 ranks x 1 stage(s) of 2 layers" in result.stdout
    written = json.loads(out.read_text())
    assert [stage["stage"] for stage in written["stages"]] == [0, 1, 2, 3]
    assert [stage["in_flight"] for stage in written["stages"]] == [4, 3, 2, 1]
    assert written["pipeline_schedule"]["layers_per_stage"] == 2


#: Meta's published config.json of Llama-3-8B (meta-llama/Meta-Llama-3-8B), its sizes
LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_the_recommended_k_fit_the_host_cap(tmp_path):
    """Issue 49, item 3: with 64 GiB over 8 ranks (8 GiB each), k = 11 (within 2%) and
    k = 19 (fits 20 GiB) need 18 and 31 GiB per rank; the answers are taken among the k
    that fit the host too, and where none does the command says so."""
    folder = tmp_path / "llama3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_3_8B))
    out = tmp_path / "plan.json"
    common = ["--hf-config", str(folder), "--seq", "8192", "--memory-budget", "20"]
    result = plan(*common, "--ranks-per-node", "8", "--host-memory", "64", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(out.read_text())
    rows = {row["k"]: row for row in written["rows"]}
    hidden = written["largest_hidden_k"]
    assert rows[hidden]["host_fits"] and rows[hidden]["overhead"] <= 0.02
    assert not rows[hidden + 1]["host_fits"] or rows[hidden + 1]["overhead"] > 0.02
    assert hidden == 4 and not rows[11]["host_fits"] and rows[11]["overhead"] <= 0.02
    fitting = [k for k, row in rows.items() if row["peak_bytes"] <= 20 * 2**30]
    assert fitting and not any(rows[k]["host_fits"] for k in fitting)
    assert written["smallest_fitting_k"] is None and written["needs_checkpointing"] is True
    assert (
        "largest k within 2.0% overhead and 8.00 GiB of host memory per rank: 4 (the host "
        "binds: k = 11 needs 17.95 GiB per rank)"
    ) in result.stdout
    assert (
        "no k fits 20.00 GiB of activations and 8.00 GiB of host memory per rank: the host "
        "binds (k = 19 fits the device and needs 31.01 GiB per rank)"
    ) in result.stdout
    # without a cap the answers are those of every k, as before
    free = plan(*common, "--json", str(out))
    assert free.returncode == 0, free.stderr[-3000:]
    assert "largest k within 2.0% overhead: 11\n" in free.stdout
    assert "smallest k that fits 20.00 GiB of activations: 19\n" in free.stdout
    written = json.loads(out.read_text())
    assert (written["largest_hidden_k"], written["smallest_fitting_k"]) == (11, 19)
