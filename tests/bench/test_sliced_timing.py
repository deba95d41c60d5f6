"""The planner's step for layers reloaded in slices beside the real offload code on the
modeled accelerator (NOTE [Timing the slices of a reload] in plan/schedule_model.py)."""

from __future__ import annotations

import pytest

from cpu_offload.bench.config import parse_args
from cpu_offload.bench.simulate import modeled_step, stack_of
from cpu_offload.device.profiles import get_profile
from cpu_offload.plan.schedule_model import LayerCosts, simulate_policy
from cpu_offload.policy.policy import KEEP, OFFLOAD

MIB = 2**20


@pytest.mark.parametrize("profile", ["h100", "910b"])
def test_the_planner_times_sliced_reloads_as_the_code_runs_them(profile):
    """Llama-3-8B layers at 1k, reloaded in 8 MiB slices (the 8k preset's 64 MiB, scaled
    with the sequence): the backward's elementwise nodes take a 28 MiB slice at once and
    wait for the next, and some take from a later slice first.  Predicted within 3% of
    the modeled step and its exposed copies within 10%, as whole-layer reloads are
    (the compute split over the slices by their bytes predicted 9% less here)."""
    config = parse_args(
        ["--preset", "llama8b-layer", "--layers", "4", "--seq", "1024", "--simulate", profile]
    )
    layers, x, layer = stack_of(config)
    device = get_profile(profile)
    costs = LayerCosts.of(layer, device)
    for offloaded in (2, 3):
        policy = [OFFLOAD] * offloaded + [KEEP] * (4 - offloaded)
        modeled = modeled_step(
            layers,
            x,
            device,
            policy=policy,
            min_offload_numel=config.min_offload_numel,
            reload_slice_bytes=8 * MIB,
            record=False,
        )
        predicted = simulate_policy(
            policy, costs, device.d2h, device.h2d, reload_slice_bytes=8 * MIB
        )
        assert len(costs.slices(8 * MIB)[0]) > 4  # reloaded in slices
        assert modeled.exposed_copy_s > 0
        assert predicted.step_s == pytest.approx(modeled.step_s, rel=0.03), policy
        assert predicted.exposed_copy_s == pytest.approx(modeled.exposed_copy_s, rel=0.1)
