"""examples/pipeline_parallel.py on 2 processes (gloo, CPU): torch.distributed.pipelining."""

from __future__ import annotations

import pytest
from helpers import torchrun


@pytest.mark.parametrize(
    "schedule,microbatches", [("1f1b", 4), ("1f1b", 8), ("interleaved", 4), ("interleaved", 8)]
)
def test_pipeline_schedules_bit_identical(schedule, microbatches):
    output = torchrun(
        "pipeline_parallel.py", 2, "--schedule", schedule, "--microbatches", str(microbatches)
    )
    for rank in (0, 1):
        assert f"rank {rank}: schedule={schedule} microbatches={microbatches}" in output
    assert output.count("gradients bit-identical: True") == 2, output[-3000:]
