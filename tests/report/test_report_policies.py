"""The step report of the policies chosen elsewhere: a memory budget's measured step and
its plan (checkpointed layers included), and the outputs a selective checkpoint moves
(``*_CPU_OFFLOAD``).  Checked against the hook-level truth, as in test_report.py."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from report_truth import Spy, assert_row_matches
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from cpu_offload import (
    create_selective_checkpoint_contexts,
    get_cpu_offload_context,
    mark_not_offload,
    offload_layers,
)
from cpu_offload.policy.planned_synchronizer import MEASURED

LAYER_KEPT = "the policy keeps its layer"


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def recompute_counter(layers: nn.ModuleList) -> Counter[int]:
    """The truth about recomputes: per layer, its forwards that ran inside a backward."""
    seen: Counter[int] = Counter()
    for index, layer in enumerate(layers):
        layer.up.register_forward_pre_hook(
            lambda *_, index=index: seen.update(
                [index] if torch._C._current_graph_task_id() != -1 else []
            )
        )
    return seen


def assert_kept_layer_matches(row: Any, spy: Spy) -> None:
    """A layer the policy keeps but the planner observes: what would move stays, and
    says so."""
    saved = spy.saved[row.index]
    would_move = [nbytes for nbytes, why in saved if why is None]
    expected = dict(spy.kept(row.index))
    if would_move:
        expected[LAYER_KEPT] = (len(would_move), sum(would_move))
    assert (row.saved_tensors, row.saved_bytes) == (len(saved), sum(n for n, _ in saved))
    assert (row.moved_tensors, row.kept_because) == (0, expected)
    assert row.kept_tensors == row.saved_tensors


def test_a_memory_budget_reports_its_measured_step_then_the_plan(monkeypatch, capsys):
    spy = Spy(monkeypatch, min_numel=0)
    torch.manual_seed(0)
    layers = nn.ModuleList(Block() for _ in range(5))
    recomputed = recompute_counter(layers)
    x = torch.randn(64, 32, requires_grad=True)

    def run() -> None:
        spy.clear()
        recomputed.clear()
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()

    # A slow link: copies cost more than recomputing, so the plan checkpoints.
    handle = offload_layers(
        layers, memory_budget="200000B", min_offload_numel=0, copy_bandwidth=50e6
    )
    assert "memory_budget=195.31 KiB: the first step runs as the model does" in repr(handle)
    run()
    report = handle.report()
    assert [row.choice for row in report.rows] == [MEASURED] * 5
    assert all(row.counted for row in report.rows) and report.moved_tensors == 0
    for row in report.rows:
        assert_kept_layer_matches(row, spy)
    assert report.to_dict()["kept_tensors/layer_kept"] > 0
    for _ in range(2):  # the plan is made when the second step starts
        run()
    policy = handle.plan.policy
    assert set(policy) - {"keep"}, policy  # the budget is below keeping everything
    assert f"memory_budget=195.31 KiB: layers {handle.plan.runs()}" in repr(handle)
    report = handle.report()
    assert [row.choice for row in report.rows] == policy
    for row in report.rows:
        checkpointed = policy[row.index].startswith("checkpoint")
        assert row.recomputed == (recomputed[row.index] == 1 if checkpointed else None)
        if checkpointed:
            assert row.recomputed is True
        if "offload" in policy[row.index]:
            assert_row_matches(row, spy)
        elif row.counted:  # layer 0 is observed in every step
            assert row.index == 0
            assert_kept_layer_matches(row, spy)
        else:
            assert row.index not in spy.saved
    scalars = report.to_dict()
    assert scalars["moved_tensors"] + scalars["kept_tensors"] == scalars["saved_tensors"]
    assert scalars["checkpointed_layers"] == sum(c.startswith("checkpoint") for c in policy)
    assert scalars["recomputed_layers"] == scalars["checkpointed_layers"]
    handle.remove()


def test_the_outputs_a_selective_checkpoint_moves_are_counted(monkeypatch, quiet):
    spy = Spy(monkeypatch, min_numel=0)
    offloaded: list[int] = []  # the truth: bytes of each *_CPU_OFFLOAD output, layer 0

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            if layer == 0 and not ctx.is_recompute:
                offloaded.append(ctx.op_output.nbytes)
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.PREFER_RECOMPUTE

    def body(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (h @ w).sin()

    torch.manual_seed(0)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
    x = torch.randn(8, 16, requires_grad=True)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]
    h = x
    for layer, w in enumerate(ws):  # noqa: B007 (policy_fn reads it)
        with ctx:
            mark_not_offload(h)  # the checkpoint's input stays: only the mm's output moves
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
            h = checkpoint(
                functools.partial(body, w), h, use_reentrant=False, context_fn=context_fn
            )
        h = sync_fn(h)
    h.sum().backward()
    row = ctx.report().rows[0]
    assert_row_matches(row, spy)
    assert (
        (row.moved_tensors, row.moved_bytes) == (len(offloaded), sum(offloaded)) == (1, 8 * 16 * 4)
    )
    assert row.kept_because == {"marked not to offload": (1, 8 * 16 * 4)}
    assert ctx.report().to_dict()["copied_bytes"] == 8 * 16 * 4


def test_recomputes_are_counted_per_pass_when_backwards_interleave():
    """One backward through two passes in flight (as interleaved and zero-bubble pipeline
    schedules interleave their backwards): each pass's step reports its own recomputes."""
    torch.manual_seed(0)
    layers = nn.ModuleList(Block() for _ in range(3))
    recomputed = recompute_counter(layers)
    policy = ["offload", "checkpoint", "keep"]
    with offload_layers(layers, policy=policy, min_offload_numel=0) as handle:
        outs = []
        for seed in range(2):
            h = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
            for layer in layers:
                h = layer(h.requires_grad_() if not h.requires_grad else h)
            outs.append(h)
        (outs[0].sum() + outs[1].sum()).backward()
        reports = handle.offload_synchronizer.recorder.steps
        report = handle.report()
    assert recomputed[1] == 2 and reports == 2  # layer 1 of each pass, two steps ended
    assert [row.recomputed for row in report.rows] == [None, True, None]
    assert report.to_dict()["recomputed_layers"] == 1
