"""A memory budget's step peak (NOTE [A step's peak, the user's statistics] in
budget_watch.py): measured without resetting the device's peak statistic, which stays the
run's peak, on the modeled accelerator (``torch.cuda`` of shapes and an allocator count)."""

from __future__ import annotations

import warnings

import torch
from helpers import MLPBlock, modeled_device

from cpu_offload import offload_layers
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda

H = 256
MIB = 2**20


def budgeted_steps(steps: int, reset_each_step: bool = False):
    """``steps`` steps of four blocks under ``memory_budget=``; per step: the device's
    peak statistic, the modeled allocator's true peak since the start, and the handle's
    measured peak."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(MLPBlock(H, 4, device="meta") for _ in range(4)))
    seen = []
    with timed_runtime(modeled_device()) as run, modeled_cuda(run.live), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan's notices
        memory = run.live.memory
        handle = offload_layers(model, memory_budget="20MiB", min_offload_numel=0)
        for _ in range(steps):
            if reset_each_step:
                torch.cuda.reset_peak_memory_stats()
            x = torch.empty(4 * H, H, device="meta", requires_grad=True)
            model(x).sum().backward()
            for p in model.parameters():
                p.grad = None
            seen.append((torch.cuda.max_memory_allocated(), memory.peak, handle.auto.measured_peak))
        plan = handle.plan
        handle.remove()
    return seen, plan


def test_the_device_peak_statistic_stays_the_runs_peak_under_a_budget():
    seen, plan = budgeted_steps(5)
    assert plan is not None and plan.fits and "checkpoint" in plan.policy
    for statistic, run_peak, _ in seen:
        assert statistic == run_peak  # what torch.cuda.max_memory_allocated() should say
    # the measured (first) step keeps everything and holds the record: the planned steps'
    # peaks are sampled at the layers' boundaries, and that is the predicted peak here
    assert seen[-1][0] == seen[0][0]
    assert seen[-1][2] == plan.predicted.peak_bytes == 20 * MIB


def test_a_user_who_resets_each_step_reads_each_steps_peak_and_the_watch_still_measures():
    seen, plan = budgeted_steps(4, reset_each_step=True)
    statistics = [statistic for statistic, _, _ in seen]
    assert statistics[-1] < statistics[0]  # a planned step peaks below the measured one
    sampled, _ = budgeted_steps(4)
    # the reset comes before the watch reads the statistic: it samples, as without one
    assert seen[-1][2] == sampled[-1][2] == plan.predicted.peak_bytes
