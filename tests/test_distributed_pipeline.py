"""examples/pipeline_parallel.py on 2 processes (gloo, CPU): torch.distributed.pipelining."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "schedule,microbatches", [("1f1b", 4), ("1f1b", 8), ("interleaved", 4), ("interleaved", 8)]
)
def test_pipeline_schedules_bit_identical(schedule, microbatches):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "pipeline_parallel.py"),
            "--schedule",
            schedule,
            "--microbatches",
            str(microbatches),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: schedule={schedule} microbatches={microbatches}" in output
    assert output.count("gradients bit-identical: True") == 2, output[-3000:]
