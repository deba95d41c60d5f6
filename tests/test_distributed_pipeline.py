"""examples/pipeline_parallel.py on 2 processes (gloo, CPU): torch.distributed.pipelining."""

from __future__ import annotations

import re

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


#: the README's and the docstring's budget, at the example's default sizes: the stages
#: with the most passes in flight cannot hold them in it
BUDGET = ["--memory-budget", "4.5MiB"]
BUDGET += ["--copy-bandwidth", "1e10"]  # the link given: no measuring copy per stage


@pytest.mark.parametrize(
    "schedule,ranks,microbatches,stages",
    [
        ("1f1b", 4, 8, [(0, 4), (1, 3), (2, 2), (3, 1)]),
        ("interleaved", 2, 8, [(0, 4), (1, 3), (2, 2), (3, 1)]),  # the README's command
    ],
)
def test_a_memory_budget_per_stage(schedule, ranks, microbatches, stages):
    """Each stage planned for its passes in flight: bit-identical, and the saved peak by the
    offloader's counts within the budget and within 2% of the plan (the example exits 1
    otherwise); the stages with most passes in flight move some whole, and the plans of
    the stages differ."""
    output = torchrun(
        "pipeline_parallel.py", ranks, "--schedule", schedule, "--microbatches",
        str(microbatches), *BUDGET,
    )  # fmt: skip
    # found wherever they are: another rank's warning may share a line with one
    lines = re.findall(r"rank \d+: stage \d+, .*?gradients bit-identical: (?:True|False)", output)
    per_rank = 1 if schedule == "1f1b" else 2
    assert len(lines) == ranks * per_rank, output[-3000:]
    assert all(line.endswith("gradients bit-identical: True") for line in lines), lines
    assert all("budget 4.50 MiB" in line for line in lines)
    for stage, in_flight in stages:
        assert f"stage {stage}, in flight {in_flight}," in output
    assert "keep 1 pass, 3 of 4 moved whole" in output  # stage 0's four passes in flight
    policies = {re.search(r"policy (.*?): gradients", line)[1] for line in lines}
    assert len(policies) >= 2, lines  # a plan per stage, not one for all


def test_a_budget_that_checkpoints_in_stages_that_move_passes_whole():
    """3 MiB with the interleaved schedule: stages 0 and 1 checkpoint a layer and move
    passes whole; the saved peak (a checkpointed layer: its inputs, and its recompute in
    its backward) matches the plan (a pass moved whole holds the recompute too) and fits
    (the example exits 1 otherwise)."""
    budget = ["--memory-budget", "3MiB", "--copy-bandwidth", "1e10"]
    output = torchrun(
        "pipeline_parallel.py", 2, "--schedule", "interleaved", "--microbatches", "8", *budget
    )
    lines = re.findall(r"rank \d+: stage \d+, .*?gradients bit-identical: (?:True|False)", output)
    assert len(lines) == 4 and all(line.endswith(": True") for line in lines), output[-3000:]
    both = [line for line in lines if "checkpoint" in line and "moved whole" in line]
    assert {re.search(r"stage (\d+)", line)[1] for line in both} == {"0", "1"}, lines
