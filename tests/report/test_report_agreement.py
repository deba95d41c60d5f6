"""Issue 39, item 5: the same quantity under the same name.  A step report counts saves
(``saved``, ``moved``, ``kept``: a tensor saved twice counts twice) and the copies that
moved them (``copied``); the statistics count copies; a plan's table says
``activations`` (each storage once) and ``copied``.  Where two of them count the same
thing, a real step gives the same number (NOTE [What the report counts] in
step_record.py)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.integrations.torchtune import OffloadActivations
from cpu_offload.models.llama import Llama, LlamaConfig
from cpu_offload.policy.policy import CHECKPOINT_OFFLOAD, OFFLOAD
from cpu_offload.report.stats import OffloadStats

streams = pytest.mark.usefixtures("streams")


def _copies(stats: OffloadStats) -> tuple[int, int, int]:
    return stats.tensors_offloaded, stats.bytes_offloaded, stats.bytes_reloaded


def _step_copies(stats: OffloadStats, before: tuple[int, int, int]) -> tuple[int, int, int]:
    after = _copies(stats)
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


def test_a_planned_step_counts_its_copies_the_same_in_the_plan_the_report_and_the_statistics():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden=64, heads=4, kv_heads=2, ffn=160, layers=4, vocab=128))
    tokens = torch.randint(0, 128, (2, 129))
    handle = offload_layers(model, memory_budget="3MiB", min_offload_numel=0, copy_bandwidth=50e9)
    for _ in range(2):  # the measured step, then the plan's first
        model.loss(tokens).backward()
    stats = handle.offload_synchronizer.stats
    before = _copies(stats)
    model.loss(tokens).backward()
    plan, report, measured = handle.plan, handle.report(), handle.auto.measured
    assert plan is not None and measured is not None
    assert plan.policy == ["offload", "offload", "keep", "keep"]
    for index, choice in enumerate(plan.policy):  # per layer: the plan's copied, the report's
        row, layer, cost = report.rows[index], measured[index], plan.layer_costs[index]
        assert layer is not None
        if choice == OFFLOAD:
            assert (row.copied_tensors, row.copied_bytes) == (
                layer.tensors_offloaded,
                cost.offloaded_bytes,
            )
        elif choice == CHECKPOINT_OFFLOAD:
            assert row.copied_bytes == cost.input_offloaded_bytes
        else:
            assert row.copied_bytes == 0
    copied_tensors, copied_bytes, reloaded_bytes = _step_copies(stats, before)
    figures = report.to_dict()
    assert figures["copied_tensors"] == report.copied_tensors == copied_tensors > 0
    assert figures["copied_bytes"] == copied_bytes == plan.predicted.offloaded_bytes > 0
    assert figures["reloaded_bytes"] == reloaded_bytes == copied_bytes
    # saves and copies differ (q, k and v save one normalised input: one copy), so their
    # names differ, in the report's words and the table's columns
    assert report.moved_tensors > report.copied_tensors
    assert report.saved_bytes > report.moved_bytes > report.copied_bytes
    mib = f"{copied_bytes / 2**20:.2f} MiB"
    assert f"copied {copied_tensors} tensors ({mib}) to the host" in str(report)
    assert f"moved {report.moved_tensors} tensors (" in str(report)
    header = str(report).splitlines()[1].split()
    assert header == ["layer", "saved", "moved", "kept", "copied", "why", "kept"]
    assert str(stats).startswith(f"copied {stats.tensors_offloaded} tensors (")
    plan_header = str(plan).splitlines()[1].split()
    assert plan_header == ["layer", "module", "choice", "activations", "copied", "inputs"]
    assert f"{plan.predicted.offloaded_bytes / 2**20:.2f} MiB copied per step" in str(plan)
    # one way to say a schedule: the handle, and the plan's own line
    assert "layers 0-1 offload, 2-3 keep" in repr(handle)
    assert plan.runs() == "0-1 offload, 2-3 keep"
    handle.remove()


class SavesTwice(nn.Module):
    """Saves its input twice (two matmuls) and a view of one result: three saves that
    move as two copies."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.b(x)  # x saved twice
        return h[:, :32].sin().sum(1, keepdim=True) + h


@streams
def test_the_context_api_counts_a_tensor_saved_twice_as_two_saves_and_one_copy():
    torch.manual_seed(0)
    layers = [SavesTwice() for _ in range(3)]
    ctx, sync_fn = get_cpu_offload_context(True, 2, 3, min_offload_numel=0)
    stats = ctx.offload_synchronizer.stats
    before = _copies(stats)
    h = torch.randn(16, 64, requires_grad=True)
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync_fn(h)
    h.sum().backward()
    report = ctx.report()
    copied_tensors, copied_bytes, reloaded_bytes = _step_copies(stats, before)
    assert report.copied_tensors == copied_tensors > 0
    assert report.copied_bytes == copied_bytes == reloaded_bytes
    for row in report.rows[:2]:
        assert row.moved_tensors > row.copied_tensors  # x: two saves, one copy
    # the context says its schedule in the words of offload_layers' handle and of a plan
    assert "3 layers per forward pass, layers 0-1 offload, 2 keep (k=2);" in repr(ctx)


def test_a_whole_forward_counts_its_copies_as_the_statistics_do():
    torch.manual_seed(0)
    model = nn.Sequential(*(SavesTwice() for _ in range(4)))
    ctx = OffloadActivations(min_offload_size=0)
    stats = ctx.offload_synchronizer.stats
    before = _copies(stats)
    with ctx:
        loss = model(torch.randn(16, 64, requires_grad=True)).sum()
    loss.backward()
    report = ctx.report()
    copied_tensors, copied_bytes, reloaded_bytes = _step_copies(stats, before)
    assert report.unit == "chunk"
    assert report.to_dict()["copied_tensors"] == copied_tensors > 0
    assert report.copied_bytes == copied_bytes == reloaded_bytes
    assert report.moved_tensors > report.copied_tensors
    assert re.search(rf"copied {copied_tensors} tensors \(", str(report))
