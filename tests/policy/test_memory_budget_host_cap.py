"""offload_layers(memory_budget=..., max_host_bytes=...) (issue 42, part 3): the plan
fits the host cap, checkpointing where the host is short; the steps move exactly what it
predicts; when nothing fits both, ``fits=False`` says which limit binds.  The issue's
shapes: six 96/288-wide MLP blocks, batch 4, seq 300 (16.1 MB planned without a cap)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload import offload_layers
from cpu_offload.engine.host_buffers import pool_reserve
from cpu_offload.policy.policy import CHECKPOINTED

BUDGET = 6_000_000  # everything but the last layer offloaded, without a cap
MOVED_WITHOUT_CAP = 5 * (460_800 + 1_382_400 * 2)  # 16.1 MB


def _blocks() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(96, 288), torch.nn.GELU(), torch.nn.Linear(288, 96))
        for _ in range(6)
    )


def _grads(layers, seed: int) -> list[torch.Tensor]:
    layers.zero_grad(set_to_none=True)
    x = torch.randn(4, 300, 96, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    return [x.grad, *(p.grad.clone() for p in layers.parameters())]


def _run(budget: int, cap: int | None, steps: int = 3):
    layers = _blocks()
    plain = [_grads(layers, seed) for seed in range(steps)]
    handle = offload_layers(
        layers,
        memory_budget=f"{budget}B",  # bytes: a bare number under 1 MiB is refused
        max_host_bytes=None if cap is None else f"{cap}B",
        min_offload_numel=0,
        copy_bandwidth=50e9,
    )
    reports = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(steps):
            grads = _grads(layers, seed)
            assert all(torch.equal(a, b) for a, b in zip(plain[seed], grads)), seed
            reports.append(handle.report().to_dict())
    plan = handle.plan
    handle.remove()
    return plan, reports, [str(w.message) for w in caught]


def test_without_a_cap_the_plan_moves_everything_it_may():
    plan, reports, _ = _run(BUDGET, None)
    assert plan.fits and plan.predicted.offloaded_bytes == MOVED_WITHOUT_CAP
    assert plan.host_cap is None and reports[-1]["moved_bytes"] == MOVED_WITHOUT_CAP


def test_a_cap_of_a_third_checkpoints_where_the_host_is_short_and_runs_as_predicted():
    cap = MOVED_WITHOUT_CAP // 3  # 5.4 MB, as in the issue
    plan, reports, said = _run(BUDGET, cap)
    assert plan.fits and plan.binding == ""
    assert plan.host_cap == cap and pool_reserve(plan.predicted.offloaded_bytes) <= cap
    assert plan.host_bytes == pool_reserve(plan.predicted.offloaded_bytes)
    assert any(choice in CHECKPOINTED for choice in plan.policy)
    assert 0 < plan.predicted.offloaded_bytes < MOVED_WITHOUT_CAP
    for report in reports[1:]:  # the steps under the plan
        assert report["moved_bytes"] == plan.predicted.offloaded_bytes
        assert "kept_bytes/host_cap" not in report  # the pool refused nothing
        assert report["host_reserved_bytes"] <= cap == report["host_cap_bytes"]
    assert "host 3.27 MiB of 5.13 MiB" in plan.line()
    assert not any("max_host_bytes" in message for message in said)


@pytest.mark.parametrize(
    "budget, cap, binding",
    [(3_300_000, 1_000_000, "max_host_bytes"), (1_000_000, 5_376_000, "memory_budget")],
    ids=["the host binds", "the device binds"],
)
def test_when_nothing_fits_both_the_plan_says_which_limit_binds(budget, cap, binding):
    plan, reports, said = _run(budget, cap)
    assert not plan.fits and plan.binding == binding
    assert pool_reserve(plan.predicted.offloaded_bytes) <= cap  # never over the host cap
    assert reports[-1]["moved_bytes"] == plan.predicted.offloaded_bytes
    assert any(f"(the limit that binds: {binding})" in message for message in said)
    if binding == "max_host_bytes":
        assert "the host cap binds" in plan.why
