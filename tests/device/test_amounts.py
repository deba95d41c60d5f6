"""One meaning for an amount of memory (issue 39): ``memory_budget=``, ``max_host_bytes=``
and the command-line flags take bytes or a size with its unit, and refuse a number too
small to be meant as bytes, at the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.bench.config import parse_args as bench_args
from cpu_offload.chunked import ChunkedOffload
from cpu_offload.cli import fraction
from cpu_offload.device.amounts import parse_bytes, parse_flag_bytes
from cpu_offload.integrations.torchtune import OffloadActivations
from cpu_offload.plan.__main__ import parser as plan_parser


def layers() -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1GiB", 2**30),
        ("512 MiB", 512 * 2**20),
        ("20GB", 20 * 10**9),
        ("0.01GiB", 10_737_418),
        ("4096B", 4096),
        (np.int64(2**30), 2**30),
        (2.0**30, 2**30),
        (0, 0),
    ],
    ids=str,
)
def test_max_host_bytes_takes_what_memory_budget_takes_everywhere(value, expected):
    handle = offload_layers(layers(), 1, max_host_bytes=value)
    made = [
        get_cpu_offload_context(True, 1, 3, max_host_bytes=value)[0],
        OffloadActivations(max_host_bytes=value),
        ChunkedOffload(max_host_bytes=value),
        handle,
    ]
    assert all(f"host_cap_bytes={expected}" in repr(m) for m in made), [repr(m) for m in made]
    handle.remove()


@pytest.mark.parametrize(
    "make",
    [
        lambda: offload_layers(layers(), 1, max_host_bytes=20),
        lambda: OffloadActivations(max_host_bytes=20),
        lambda: ChunkedOffload(max_host_bytes=20),
    ],
    ids=["offload_layers", "OffloadActivations", "ChunkedOffload"],
)
def test_a_small_max_host_bytes_is_refused_everywhere(make):
    with pytest.raises(ValueError) as raised:
        make()
    assert "max_host_bytes=20 would be 20 bytes: a number is a count of bytes" in str(raised.value)
    assert "Write max_host_bytes='20GiB' for 20 GiB" in str(raised.value)


def test_a_small_memory_budget_is_refused_at_the_call_not_after_a_step():
    model = layers()
    with pytest.raises(ValueError) as raised:
        offload_layers(model, memory_budget=20)
    assert str(raised.value).startswith(
        "offload_layers: memory_budget=20 would be 20 bytes: a number is a count of bytes"
    )
    assert "memory_budget='20GiB'" in str(raised.value)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model)
    handle = offload_layers(model, memory_budget=np.int64(2**30))  # NumPy integers are bytes
    assert handle.auto.memory_budget == 2**30
    handle.remove()


def test_one_parser_for_the_api_and_the_flags():
    assert parse_bytes("0.5GiB", "memory_budget", "f") == parse_flag_bytes("0.5", "--x") == 2**29
    assert parse_flag_bytes("512MiB", "--x") == parse_bytes(2**29, "memory_budget", "f")
    assert parse_flag_bytes("0.01GiB", "--x") == 10_737_418
    with pytest.raises(ValueError, match="memory_budget=20 would be 20 bytes"):
        parse_bytes("20", "memory_budget", "f")


def test_the_planner_takes_sizes_and_percentages():
    args = plan_parser().parse_args(["--memory-budget", "0.01GiB", "--overhead", "5%"])
    assert (args.memory_budget, args.overhead) == (10_737_418, 0.05)
    args = plan_parser().parse_args(["--memory-budget", "20", "--overhead", "0.05"])
    assert (args.memory_budget, args.overhead) == (20 * 2**30, 0.05)  # a bare number is GiB
    assert fraction("1") == 1.0 and fraction("150%") == 1.5


def test_a_bare_overhead_above_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        plan_parser().parse_args(["--overhead", "5"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "python -m cpu_offload.plan: error: argument --overhead: '5': expected a fraction up "
        "to 1 (0.02 is 2%) or a percentage such as 5%; a bare 5 would mean 500%: write 500% "
        "if you mean that\n"
    )


def test_the_benchmark_takes_sizes_too():
    config = bench_args(["--preset", "tiny", "--simulate", "h100", "--memory-budget", "0.5,512MiB"])
    assert config.memory_budget == [0.5, 0.5]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("20G", 20 * 2**30),  # Slurm's --mem=20G, free -h: GiB
        ("20Gi", 20 * 2**30),
        ("20 g", 20 * 2**30),
        ("20GiB", 20 * 2**30),
        ("20GB", 20 * 10**9),
        ("1.5T", int(1.5 * 2**40)),
        ("512M", 512 * 2**20),
        ("1e9", 10**9),  # the string of a number is that number
        ("2.5e3MiB", 2500 * 2**20),
    ],
    ids=str,
)
def test_one_rule_for_units_in_the_api_and_the_flags(text, expected):
    assert parse_bytes(text, "memory_budget", "f") == expected
    bare = text.replace(".", "").replace("e", "").isdigit()  # a bare number on a flag is GiB
    assert parse_flag_bytes(text, "--memory-budget") == expected * (2**30 if bare else 1)
    handle = offload_layers(layers(), 1, max_host_bytes=text)
    assert f"host_cap_bytes={expected}" in repr(handle)
    handle.remove()


def test_a_number_and_its_string_are_one_amount():
    assert parse_bytes("1e9", "memory_budget", "f") == parse_bytes(1e9, "memory_budget", "f")
    with pytest.raises(ValueError, match=r"memory_budget=1000 would be 1000 bytes"):
        parse_bytes("1e3", "memory_budget", "f")


def test_numpy_integers_are_ints_for_every_count():
    handle = offload_layers(layers(), 1, keep_passes=np.int64(1), max_host_bytes=np.int64(2**30))
    assert "keep 1 pass" in repr(handle), repr(handle)
    handle.remove()
    _, _, controller = get_cpu_offload_context(
        True,
        1,
        3,
        manual_synchronization=True,
        min_offload_numel=np.int64(16),
        reload_slice_bytes=np.int64(4096),
        reload_on_demand_layers=[np.int64(0)],
    )
    assert type(controller.reload_slice_bytes) is int and controller.reload_slice_bytes == 4096
    assert controller.reload_on_demand_layers == {0}
    with pytest.raises(TypeError, match="keep_passes must be an int >= 1"):
        offload_layers(layers(), 1, keep_passes=1.0)
    with pytest.raises(TypeError, match="reload_slice_bytes must be None"):
        offload_layers(layers(), 1, reload_slice_bytes=4096.0)


def test_reload_slice_bytes_takes_a_size_string():
    _, _, controller = get_cpu_offload_context(
        True, 1, 3, manual_synchronization=True, reload_slice_bytes="1MiB"
    )
    assert controller.reload_slice_bytes == 2**20
    for text, expected in (("64", 64), ("1e3", 1000)):  # a number's string: bytes, as the int
        _, _, controller = get_cpu_offload_context(
            True, 1, 3, manual_synchronization=True, reload_slice_bytes=text
        )
        assert controller.reload_slice_bytes == expected
    with pytest.raises(ValueError, match="reload_slice_bytes='64.5' is not a whole number"):
        get_cpu_offload_context(True, 1, 3, reload_slice_bytes="64.5")


def test_a_zero_memory_budget_says_what_it_would_mean():
    with pytest.raises(ValueError) as raised:
        offload_layers(layers(), memory_budget=0)
    assert str(raised.value).startswith(
        "offload_layers: memory_budget=0 is 0 bytes for saved activations, which no policy can meet"
    )
    assert "pass num_layers instead" in str(raised.value)
