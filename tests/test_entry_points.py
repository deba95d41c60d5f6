"""The main job and the examples run and report matching gradients."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from helpers import load_example

from cpu_offload.demo import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_prints_table_and_matches(capsys):
    code = main(
        [
            "--layers",
            "3",
            "--hidden",
            "64",
            "--seq",
            "32",
            "--batch",
            "2",
            "--vocab",
            "128",
            "--steps",
            "2",
            "--min-offload-numel",
            "0",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("cpu ")]
    assert len(rows) == 3  # no offload, k=1, k=2
    assert all(row.rstrip().endswith("yes") for row in rows)
    offloaded = [float(row.split()[2]) for row in rows]
    assert offloaded[0] == 0 and 0 < offloaded[1] < offloaded[2]
    # The CPU reports no memory: the planner's activations, less what really moved.
    planned = [float(row.split()[3]) for row in rows]
    assert all(row.split()[4] == "(planned)" for row in rows)
    for moved, left in zip(offloaded, planned):
        assert left == pytest.approx(planned[0] - moved, abs=0.02)
    assert "on a GPU this table shows the measured peak" in out


def test_demo_rejects_single_layer(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--layers", "1"])
    assert exit_info.value.code == 2
    assert "argument --layers: '1': expected an int >= 2" in capsys.readouterr().err


def test_demo_prints_a_line_per_configuration_as_it_runs(capsys):
    main(["--layers", "2", "--hidden", "32", "--seq", "8", "--batch", "1", "--steps", "1"])
    out = capsys.readouterr().out
    assert "training 1 steps without offload ... " in out
    assert "training 1 steps offloading k=1 of 2 layers ... " in out
    assert out.index("offloading k=1") < out.index("grads bit-identical")  # before the table
    assert "Step times on a CPU are noisy and not the point here" in out


def test_basic_example(capsys):
    runpy.run_path(str(ROOT / "examples" / "basic.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "gradients bit-identical: True" in out
    assert "offloaded 16.0 MiB in 8 tensors" in out


def test_megatron_style_example(capsys):
    module = load_example("megatron_style")
    assert module.main(["--steps", "2"]) == 0  # default sizes: above the threshold
    out = capsys.readouterr().out
    assert "gradients bit-identical: True" in out
    assert float(out.split(" MiB offloaded")[0].split()[-1]) > 0
