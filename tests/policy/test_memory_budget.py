"""offload_layers(model, memory_budget=...): the first step measured, the policy chosen per
layer and applied from the next, on three models, for budgets from loose to impossible
(bit-identical gradients at every step, exactly the predicted bytes moved, the predicted
peak within the budget or fits=False with the reason)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import small_llama_config
from hosts import require

from cpu_offload import offload_layers
from cpu_offload.plan import measure_layer
from cpu_offload.plan.layers import hf_layer
from cpu_offload.policy.checkpointing import CheckpointedForward
from cpu_offload.policy.measured_step import census_rows
from cpu_offload.policy.policy import CHECKPOINTED

STEPS = 3


class Block(torch.nn.Module):
    """A user-written block: pre-norm MLP with dropout and a residual."""

    def __init__(self, width: int, batch_norm: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(width) if batch_norm else torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def sequential(batch_norm_at: int | None = None) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block(32, i == batch_norm_at) for i in range(5)))


def grads_of(model: torch.nn.Module, step: Callable[[], None]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every run
    step()
    return [p.grad.clone() for p in model.parameters()]


def run_budgets(model, step, budgets, capsys, **options):
    """Each budget: STEPS steps through offload_layers(memory_budget=...), checked against
    the plain model at every step; returns the plans."""
    plain = grads_of(model, step)
    plans = []
    for budget in budgets:
        handle = offload_layers(model, memory_budget=f"{budget}B", **options)
        stats = handle.offload_synchronizer.stats
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for index in range(STEPS):
                before = stats.bytes_offloaded
                grads = grads_of(model, step)
                assert all(torch.equal(a, b) for a, b in zip(plain, grads)), (budget, index)
                moved = stats.bytes_offloaded - before
                if index == 0:  # the measuring step runs as the plain model does
                    assert handle.plan is None and moved == 0
                    assert handle.auto is not None and len(handle.auto.measured) == len(
                        model_layers(model)
                    )
                else:
                    assert moved == handle.plan.predicted.offloaded_bytes, (budget, index)
        plan = handle.plan
        assert stats.forward_passes == STEPS
        assert plan.fits == (plan.predicted.peak_bytes <= plan.memory_budget)
        lines = [line for line in capsys.readouterr().out.splitlines() if "memory_budget=" in line]
        assert lines == [
            f"cpu_offload: offload_layers(memory_budget={said(budget)}): {plan.line()}"
        ]
        said_nothing_fits = [
            w for w in caught if "no policy fits the memory budget" in str(w.message)
        ]
        assert bool(said_nothing_fits) == (not plan.fits)
        if not plan.fits:
            assert plan.why.startswith("why nothing fits") and plan.why in str(
                said_nothing_fits[0].message
            )
        handle.remove()
        plans.append(plan)
    assert plans[0].policy == ["keep"] * len(plans[0].policy)  # a loose budget changes nothing
    assert not plans[-1].fits
    return plans


def said(budget: int) -> str:
    from cpu_offload.policy.memory_budget import size

    return size(budget)


def model_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from cpu_offload.policy.layer_discovery import find_layers

    return find_layers(model)


def keep_all_peak(model, step, **options) -> int:
    """The predicted peak of keeping every layer, from a measured step."""
    handle = offload_layers(model, memory_budget="1TiB", **options)
    for _ in range(2):
        grads_of(model, step)
    peak = handle.plan.predicted.peak_bytes
    handle.remove()
    return peak


def budgets_below(peak: int) -> list[int]:
    return [2 * peak] + [int(peak * f) for f in (0.75, 0.5, 0.3, 0.15)] + [1]


def choices(plans) -> set[str]:
    return {choice for plan in plans for choice in plan.policy}


def test_a_sequential_of_user_blocks(capsys):
    model = sequential()
    x = torch.randn(64, 32, requires_grad=True)
    step = lambda: model(x).sum().backward()  # noqa: E731
    # A slow link (50 MB/s): copies cost more than recomputing these blocks.
    options = {"min_offload_numel": 0, "copy_bandwidth": 50e6}
    peak = keep_all_peak(model, step, **options)
    capsys.readouterr()
    plans = run_budgets(model, step, budgets_below(peak), capsys, **options)
    assert choices(plans) & set(CHECKPOINTED)


def test_a_hugging_face_llama(capsys, tmp_path):
    transformers = require("transformers")
    config = small_llama_config(transformers, tmp_path)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 128))
    step = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    options = {"min_offload_numel": 2**14}
    peak = keep_all_peak(model, step, **options)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpointed layers run without the cache
        plans = run_budgets(model, step, budgets_below(peak), capsys, **options)
    assert {"offload", "checkpoint+offload"} <= choices(plans)


def test_choices_per_submodule_under_a_budget(capsys, tmp_path):
    """modules= composes with a budget: the measured step sees what the submodules keep,
    the plan's bytes are what then moves, every step bit-identical."""
    transformers = require("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(small_llama_config(transformers, tmp_path))
    ids = torch.randint(0, 128, (2, 96))  # not the Llama test's: its warnings are once per site
    step = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    options = {"min_offload_numel": 2**14, "modules": {"core_attn": "keep"}}
    peak = keep_all_peak(model, step, **options)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpointed layers run without the cache
        plans = run_budgets(model, step, budgets_below(peak), capsys, **options)
    assert "offload" in choices(plans)
    measured = {}
    for given in (None, options["modules"]):
        handle = offload_layers(model, memory_budget="1TiB", min_offload_numel=2**14, modules=given)
        grads_of(model, step)
        measured[given is None] = handle.auto.measured[0]
        handle.remove()
    with_choices, without = measured[False], measured[True]
    assert with_choices.saved_bytes == without.saved_bytes  # the same layer, measured
    assert with_choices.kept_by_reason["modules= keep"] > 0
    assert with_choices.offloaded_bytes < without.offloaded_bytes


def test_a_model_of_dense_and_expert_layers(capsys):
    transformers = require("transformers")
    config = transformers.Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0, 2],  # dense layers 0 and 2, experts in 1 and 3
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config)
    ids = torch.randint(0, 128, (2, 64))
    step = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    handle = offload_layers(model, memory_budget="1TiB", min_offload_numel=0)
    grads_of(model, step)
    measured = handle.auto.measured
    handle.remove()
    assert measured[0].saved_bytes == measured[2].saved_bytes != measured[1].saved_bytes
    peak = keep_all_peak(model, step, min_offload_numel=0)
    capsys.readouterr()
    plans = run_budgets(model, step, budgets_below(peak), capsys, min_offload_numel=0)
    assert "offload" in choices(plans)
    assert any(plan.layer_costs[0] != plan.layer_costs[1] for plan in plans)


def test_measured_bytes_match_the_census_of_a_hugging_face_llama(tmp_path):
    transformers = require("transformers")
    config = small_llama_config(transformers, tmp_path)
    spec = hf_layer(str(tmp_path / "config.json"), 128, 2, torch.float32, "cpu")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 128))
    for min_numel in (0, 2**14):
        census = measure_layer(
            spec.make_layer,
            spec.inputs,
            kwargs=spec.kwargs,
            min_offload_numel=min_numel,
            attention="cpu",
        )
        handle = offload_layers(model, memory_budget="1TiB", min_offload_numel=min_numel)
        model(input_ids=ids, labels=ids).loss.backward()
        rows = census_rows(handle.auto.measured, census)
        assert len(rows) == 4 * 7 and all(measured == counted for _, _, measured, counted in rows)
        assert all(layer.kept_by_reason == census.kept_by_reason for layer in handle.auto.measured)
        assert bool(census.kept_by_reason) == (min_numel > 0)
        handle.remove()


def test_a_layer_with_checkpoint_hazards_is_never_checkpointed(capsys):
    model = sequential(batch_norm_at=1)
    x = torch.randn(64, 32)
    step = lambda: model(x).sum().backward()  # noqa: E731
    plain = sequential(batch_norm_at=1)
    for budget in (1, 120_000):
        handle = offload_layers(
            model, memory_budget=f"{budget}B", min_offload_numel=0, copy_bandwidth=50e6
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing fits 1 byte (tested above)
            for _ in range(STEPS):
                grads_of(model, step)
                grads_of(plain, lambda: plain(x).sum().backward())
        assert handle.plan.policy[1] in ("keep", "offload")
        assert any(choice in CHECKPOINTED for choice in handle.plan.policy)
        assert handle.plan.checkpoint_refused == [
            "layer 1 (Block): norm (BatchNorm1d) updates its running statistics in training "
            "mode, and again in the recompute (eval() or track_running_stats=False avoid it)"
        ]
        handle.remove()
    # the statistics were updated once per forward, as without offload
    assert torch.equal(model[1].norm.running_mean, plain[1].norm.running_mean)
    assert model[1].norm.num_batches_tracked == plain[1].norm.num_batches_tracked


def test_a_larger_input_is_measured_again_and_planned_for(capsys):
    model = sequential()
    short, long = torch.randn(64, 32), torch.randn(256, 32)
    peak = keep_all_peak(model, lambda: model(short).sum().backward(), min_offload_numel=0)
    plain = grads_of(model, lambda: model(long).sum().backward())
    budget = int(peak * 0.9)  # 4x the input still fits, offloading more
    handle = offload_layers(model, memory_budget=f"{budget}B", min_offload_numel=0)
    stats = handle.offload_synchronizer.stats
    for x in (short, short):
        grads_of(model, lambda x=x: model(x).sum().backward())
    first = handle.plan
    assert first.fits and first.policy != ["keep"] * 5
    capsys.readouterr()
    with pytest.warns(
        UserWarning, match="layer 0 saved .*, more than the .* the plan was made for"
    ):
        grads = grads_of(model, lambda: model(long).sum().backward())
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert handle.plan is first  # that step ran the plan made for the short input
    before = stats.bytes_offloaded
    grads = grads_of(model, lambda: model(long).sum().backward())
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    longer = handle.plan
    assert longer is not first and longer.memory_budget == budget and longer.fits
    assert longer.predicted.offloaded_bytes > first.predicted.offloaded_bytes
    assert longer.layer_costs[2].saved_bytes == 4 * first.layer_costs[2].saved_bytes
    assert stats.bytes_offloaded - before == longer.predicted.offloaded_bytes
    assert "memory_budget=" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a smaller input keeps the plan, silently
        grads_of(model, lambda: model(short).sum().backward())
    assert handle.plan is longer
    handle.remove()


def test_a_step_over_its_prediction_is_planned_again_once(capsys):
    from cpu_offload.testing import strict_runtime

    model = sequential()
    x = torch.randn(64, 32)
    step = lambda: model(x).sum().backward()  # noqa: E731
    gradients = sum(p.numel() * 4 for p in model.parameters())  # allocated by each step
    with strict_runtime("cuda") as runtime:
        reported = {"peak": 0}
        runtime.memory_allocated = lambda device=None: 1000
        runtime.max_memory_allocated = lambda device=None: 1000 + gradients + reported["peak"]
        budget = 200_000
        handle = offload_layers(model, memory_budget=f"{budget}B", min_offload_numel=0)
        for _ in range(2):
            grads_of(model, step)
        first = handle.plan
        reported["peak"] = first.predicted.peak_bytes + budget // 20  # within the margin
        grads_of(model, step)
        assert handle.plan is first and handle.auto.measured_peak == reported["peak"]
        excess = budget // 2
        reported["peak"] = first.predicted.peak_bytes + excess
        with pytest.warns(UserWarning, match="more than predicted .* taken off the budget"):
            grads_of(model, step)
        second = handle.plan
        assert second is not first and second.memory_budget == budget - excess
        assert second.predicted.peak_bytes <= first.predicted.peak_bytes
        reported["peak"] = second.predicted.peak_bytes + budget  # far over: warned once only
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            grads_of(model, step)
            grads_of(model, step)
        assert handle.plan is second
        handle.remove()
    assert capsys.readouterr().out.count("memory_budget=195.31 KiB") == 2


def test_auto_is_the_free_memory_less_the_margin_and_the_gradients_to_come(monkeypatch, capsys):
    import cpu_offload.device.backend

    model = sequential()
    x = torch.randn(64, 32)
    free = 4 * 2**20
    monkeypatch.setattr(cpu_offload.device.backend, "host_memory_available", lambda: free)
    handle = offload_layers(model, memory_budget="auto", min_offload_numel=0)
    grads_of(model, lambda: model(x).sum().backward())
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # "auto" is read after one
    grads_of(model, lambda: model(x).sum().backward())
    gradients = sum(p.numel() * 4 for p in model.parameters())  # set to None before the step
    assert handle.plan.memory_budget == int(free * 0.9) - gradients
    assert "offload_layers(memory_budget='auto')" in capsys.readouterr().out
    handle.remove()


def test_auto_needs_a_runtime_that_reports_free_memory():
    from cpu_offload.testing import strict_runtime

    with strict_runtime("cuda"), pytest.raises(ValueError) as error:
        offload_layers(sequential(), memory_budget="auto")
    assert str(error.value).startswith(
        "offload_layers: memory_budget='auto' needs the device's free memory, which its "
        "runtime (cpu) does not report; give a number of bytes or a string such as '20GiB'."
    )


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        ("20GiB", 20 * 2**30),
        (" 512 MiB ", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("64kib", 65536),
        ("100B", 100),
        ("0.01GiB", 10_737_418),
        ("4194304", 4_194_304),
        (2**20, 2**20),
        (2e6, 2_000_000),
        (np.int64(2**30), 2**30),
        (np.uint32(2**21), 2**21),
        ("20G", 20 * 2**30),
        ("1e9", 10**9),
        ("AUTO", "auto"),
    ],
)
def test_a_budget_is_bytes_a_size_or_auto(budget, expected):
    from cpu_offload.policy.memory_budget import parse_memory_budget

    assert parse_memory_budget(budget, "offload_layers") == expected


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        ("20 gigs", ValueError, "memory_budget='20 gigs' is not a size; give a number of bytes"),
        ("-1GiB", ValueError, "is not a size"),
        (-1, ValueError, "memory_budget must be >= 0 bytes; give a number of bytes"),
        (float("inf"), ValueError, "memory_budget must be >= 0 bytes; give a number"),
        (True, TypeError, "memory_budget must be a number of bytes (an int >= 1 MiB, or 0), or"),
        ([1], TypeError, "got list [1]"),
        (
            20,
            ValueError,
            "memory_budget=20 would be 20 bytes: a number is a count of bytes, and one under "
            "1 MiB is refused as a likely slip of the unit. Write memory_budget='20GiB' for 20 "
            "GiB (or '20B' if you mean bytes).",
        ),
        (20.5, ValueError, "memory_budget=20.5 would be 20.5 bytes: a number is a count of"),
        (np.int64(1000), ValueError, "memory_budget=1000 would be 1000 bytes"),
        ("1000", ValueError, "memory_budget=1000 would be 1000 bytes"),
        (3 * 2**20 + 0.5, ValueError, "memory_budget=3145728.5 is not a whole number of bytes"),
        ("20.5B", ValueError, "memory_budget='20.5B' is a fractional number of bytes"),
    ],
)
def test_a_bad_budget_is_refused(budget, error, message):
    with pytest.raises(error, match="^offload_layers: ") as raised:
        offload_layers(sequential(), memory_budget=budget)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: offload_layers(m, 2, memory_budget="1GiB"),
            TypeError,
            "pass either num_offloaded_layers (k) or policy=[...] or memory_budget=..., not both",
        ),
        (
            lambda m: offload_layers(m, memory_budget="1GiB", manual_synchronization=True),
            TypeError,
            "memory_budget= chooses the layers to offload and schedules them itself; "
            "manual_synchronization= does not combine with it",
        ),
        (
            lambda m: offload_layers(m, memory_budget="1GiB", offloaded_layers=[0]),
            TypeError,
            "offloaded_layers= and memory_budget=... both choose the layers to offload",
        ),
        (
            lambda m: offload_layers(m, memory_budget="1GiB", copy_bandwidth=-1),
            ValueError,
            "copy_bandwidth must be bytes per second > 0",
        ),
        (
            lambda m: offload_layers(m, 1, copy_bandwidth=1e9),
            TypeError,
            "copy_bandwidth= is the link the memory_budget= plan assumes; pass it with "
            "memory_budget",
        ),
    ],
)
def test_budget_misuse_is_refused(call, error, message):
    with pytest.raises(error) as raised:
        call(sequential())
    assert str(raised.value).startswith("offload_layers: ")
    assert message in str(raised.value)


def test_the_link_from_a_check_json_and_remove_restores_the_modules(tmp_path, capsys):
    import json

    path = tmp_path / "check.json"
    figures = {"d2h_bytes_per_s": 2e9, "h2d_bytes_per_s": 3e9}
    path.write_text(json.dumps({"checks": [{"figures": figures}]}))
    model = sequential()
    x = torch.randn(64, 32)
    handle = offload_layers(
        model, memory_budget="1B", copy_bandwidth=str(path), min_offload_numel=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            grads_of(model, lambda: model(x).sum().backward())
    assert handle.auto.link == (2e9, 3e9)
    assert all(isinstance(block.__dict__["forward"], CheckpointedForward) for block in model)
    handle.remove()
    assert all("forward" not in block.__dict__ for block in model)
    assert all(not block._forward_pre_hooks and not block._forward_hooks for block in model)


def test_a_forward_without_grad_or_one_that_raises_is_not_the_measured_step(capsys):
    model = sequential()
    x = torch.randn(64, 32)
    plain = grads_of(model, lambda: model(x).sum().backward())
    handle = offload_layers(model, memory_budget="300000B", min_offload_numel=0)
    with torch.no_grad():
        model(x)  # evaluation saves nothing: not a step to plan from
    model[2].register_forward_hook(lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x)
    model[2]._forward_hooks.popitem()
    assert handle.auto.measured is None
    for _ in range(3):
        assert all(
            torch.equal(a, b)
            for a, b in zip(plain, grads_of(model, lambda: model(x).sum().backward()))
        )
    assert handle.plan is not None and handle.auto.measured[0].saved_bytes > 0
    assert handle.plan.policy != ["keep"] * 5
    handle.remove()


def test_the_clock_reads_timing_events_on_a_device():
    from cpu_offload.policy.measured_step import LayerClock
    from cpu_offload.testing import strict_runtime

    with strict_runtime("cuda") as runtime:
        clock = LayerClock(runtime.backend(), 3)
        clock.on_host = False  # as on an accelerator: events on the compute stream
        for layer in (0, 2):
            clock.start(layer)
            torch.randn(256, 256) @ torch.randn(256, 256)
            clock.stop(layer)
        seconds = clock.seconds()
    assert seconds[1] is None and all(s is not None and s > 0 for s in (seconds[0], seconds[2]))


def test_the_measured_step_reads_the_tests_ticking_clock(ticking_clock):
    """The layer times a plan is made from come from the injected clock (tests/conftest.py),
    the same on an idle machine and a loaded one: each layer's forward is one tick."""
    model = sequential()
    x = torch.randn(64, 32)
    handle = offload_layers(model, memory_budget="1GiB", min_offload_numel=0)
    grads_of(model, lambda: model(x).sum().backward())
    times = [m.forward_s for m in handle.auto.measured]
    assert times == pytest.approx([ticking_clock.TICK] * len(model), rel=1e-9)
    handle.remove()


def test_every_clock_the_offloader_reads_ticks_in_tests():
    """A module of the offloader that reads ``time`` is one the tests' clock replaces, or
    one that only prints times (the commands)."""
    import pathlib
    import re

    import conftest

    root = pathlib.Path(__file__).parents[2] / "cpu_offload"
    printing_only = {
        "cpu_offload.check",
        "cpu_offload.check_full",
        "cpu_offload.check_rows",
        "cpu_offload.demo",
    }
    reading = {
        ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for path in root.rglob("*.py")
        if re.search(r"^import time$", path.read_text(), re.M) and "bench" not in path.parts
    }
    assert reading - printing_only == set(conftest.TIMED_MODULES)
