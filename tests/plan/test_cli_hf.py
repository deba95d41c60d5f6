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
