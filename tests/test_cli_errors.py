"""Bad input on the command line: one line naming the flag, the value and what is
allowed, exit status 2, no traceback; every tool, run as a user runs it."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch
from hosts import require

CASES = [
    ("cpu_offload", ["--seq", "-5"], "argument --seq: '-5': expected an int >= 1"),
    ("cpu_offload", ["--layers", "1"], "argument --layers: '1': expected an int >= 2"),
    ("cpu_offload", ["--offload", "1,9"], "--offload 1,9: expected values in 1..3 (--layers 4"),
    ("cpu_offload", ["--offload", "x"], "argument --offload: 'x': expected comma-separated ints"),
    ("cpu_offload", ["--device", "tpu"], "device='tpu' is not a device this offloader can use"),
    ("cpu_offload", ["--hidden", "30"], "--hidden 30: expected a multiple of --heads 4"),
    ("cpu_offload.plan", ["--seq", "-5"], "argument --seq: '-5': expected an int >= 1"),
    ("cpu_offload.plan", ["--overhead", "-1"], "argument --overhead: '-1': expected a fraction"),
    ("cpu_offload.plan", ["--memory-budget", "0"], "argument --memory-budget: '0': expected a"),
    ("cpu_offload.plan", ["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    ("cpu_offload.plan", ["--device", "tpu"], "--device tpu: unknown device profile 'tpu'"),
    ("cpu_offload.plan", ["--hf-config", "missing/config.json"], "no such file"),
    ("cpu_offload.bench", ["--steps", "0"], "argument --steps: '0': expected an int >= 1"),
    ("cpu_offload.bench", ["--offload", "4"], "--offload 4: expected values in 1..3"),
    ("cpu_offload.bench", ["--modes", "none,fast"], "--modes none,fast: unknown mode 'fast'"),
    ("cpu_offload.bench", ["--device", "cuda"], "torch.cuda reports no available device"),
    ("cpu_offload.bench", ["--simulate", "tpu"], "--simulate tpu: unknown device profile 'tpu'"),
    ("cpu_offload.check", ["--device", "tpu"], "device='tpu' is not a device this offloader"),
    (
        "cpu_offload.plan.module_search",
        ["--budgets", "-1"],
        "--budgets: '-1': expected a number > 0",
    ),
    ("cpu_offload.plan.module_search", ["--presets", "huge"], "--presets: unknown preset 'huge'"),
    ("cpu_offload.plan.module_search", ["--devices", "tpu"], "--devices: unknown device profile"),
]


def run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "module, args, message", CASES, ids=[f"{m}{' '.join(a)}" for m, a, _ in CASES]
)
def test_bad_input_is_one_line_and_exit_2(module, args, message):
    if module == "cpu_offload.bench" and args[0] == "--device":
        from cpu_offload.device.runtime import available_device_type

        if available_device_type() == "cuda":
            pytest.skip("this machine has a CUDA device")
    result = run(module, args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"python -m {module}: error: ")
    assert message in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    "content, message",
    [("{not json", "not a JSON file"), (json.dumps([1, 2]), "a JSON object with a model_type")],
    ids=["malformed", "not-a-config"],
)
def test_a_bad_hf_config_file_is_named_before_anything_is_imported(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    result = run("cpu_offload.plan", ["--hf-config", str(path)])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert f"--hf-config {path}" in result.stderr


# ------------------------------------------- checked before anything runs, in-process


def bench_main(argv):
    from cpu_offload.bench.main import main

    return main(argv)


def check_main(argv):
    from cpu_offload.check import main

    return main(argv)


def plan_main(argv):
    from cpu_offload.plan.__main__ import main

    return main(argv)


TOOLS = {"bench": bench_main, "check": check_main, "plan": plan_main}


def refused(tool, argv, capsys):
    """The one line on stderr of a run that exits with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        TOOLS[tool](argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"python -m cpu_offload.{tool}: error: ")
    assert captured.out == ""  # nothing ran
    return lines[0]


@pytest.mark.parametrize("tool", ["bench", "check", "plan"])
def test_an_output_file_in_a_missing_folder_is_refused_before_the_run(tool, tmp_path, capsys):
    path = tmp_path / "missing" / "out.json"
    line = refused(tool, ["--json", str(path)], capsys)
    assert f"argument --json: '{path}': expected a path in an existing folder" in line
    assert f"('{tmp_path / 'missing'}' does not exist: create it first)" in line
    line = refused(tool, ["--json", str(tmp_path)], capsys)
    assert f"argument --json: '{tmp_path}': expected a file name, not a folder" in line


@pytest.mark.parametrize("tool", ["bench", "plan"])
def test_a_plot_must_be_a_format_matplotlib_writes(tool, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.xyz"
    line = refused(tool, ["--plot", str(path)], capsys)
    assert f"argument --plot: '{path}': expected a file name ending in one of " in line
    assert ".pdf, " in line and ".png, " in line
    path = tmp_path / "missing" / "plot.png"
    assert "expected a path in an existing folder" in refused(tool, ["--plot", str(path)], capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hidden", "100", "--heads", "3"], "--hidden 100: expected a multiple of --heads 3"),
        (["--heads", "3"], "--heads 3: expected a divisor of --hidden 256 (the tiny preset's)"),
        (["--kv-heads", "3"], "--kv-heads 3: expected a divisor of --heads 4 (the tiny preset's)"),
        (
            ["--hidden", "12", "--heads", "4", "--kv-heads", "1"],
            "--hidden 12 over --heads 4: heads of 3 features; expected an even number",
        ),
        (
            ["--layers", "1"],
            "--layers 1: the offload mode needs at least 2 layers (the last layer is never "
            "offloaded); pass --layers 2 or more, or --modes without offload",
        ),
    ],
    ids=["hidden-heads", "heads", "kv-heads", "odd-head", "one-layer"],
)
def test_bench_shapes_are_checked_and_name_the_flags_given(argv, message, capsys):
    line = refused("bench", argv, capsys)
    assert message in line
    assert "--offload" not in line  # a flag never passed is not blamed


def test_bench_takes_the_presets_k_that_fit_the_layers():
    from cpu_offload.bench.config import parse_args

    assert parse_args(["--layers", "3"]).offload == [1, 2]  # the tiny preset says 1,2,3
    assert parse_args(["--preset", "llama8b-layer", "--layers", "2"]).offload == [1]


def test_bench_refuses_a_run_that_cannot_fit_before_allocating_it():
    result = run("cpu_offload.bench", ["--seq", "99999999"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("python -m cpu_offload.bench: error: --seq 99999999 --batch 2 ")
    assert "the run needs at least " in lines[0]
    assert "GiB available; use a smaller --seq, --batch, --steps or --layers" in lines[0]
    assert "measuring" not in result.stdout  # nothing ran


def test_bench_says_what_to_do_when_it_runs_out_of_memory(monkeypatch, capsys):
    bench = importlib.import_module("cpu_offload.bench.main")

    def out_of_memory(config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(bench, "_set_threads", lambda config: 1)
    monkeypatch.setattr(bench, "run_benchmark", out_of_memory)
    assert bench.main(["--seq", "64"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        "python -m cpu_offload.bench: error: --seq 64 --batch 2 --hidden 256 --layers 4 "
        "--steps 5: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); use a "
        "smaller --seq, --batch, --steps or --layers"
    )


def test_bench_lets_other_errors_through(monkeypatch):
    bench = importlib.import_module("cpu_offload.bench.main")

    def broken(config):
        raise RuntimeError("a bug")

    monkeypatch.setattr(bench, "_set_threads", lambda config: 1)
    monkeypatch.setattr(bench, "run_benchmark", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        bench.main(["--seq", "64"])


@pytest.mark.parametrize("tool", ["bench", "check"])
def test_an_npu_without_torch_npu_says_how_to_install_it(tool, capsys):
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    line = refused(tool, ["--device", "npu"], capsys)
    assert (
        "argument --device: device 'npu' needs the torch_npu package and Ascend CANN; install "
        "them (pip install 'cpu-offload[npu]') or choose another device." in line
    )
    assert "is not a device this offloader can use" not in line


def test_plan_layers_are_bounded(capsys):
    line = refused("plan", ["--preset", "tiny", "--layers", "100000"], capsys)
    assert "argument --layers: '100000': expected an int in 2..512" in line
    line = refused("plan", ["--preset", "tiny", "--layers", "200", "--memory-budget", "1"], capsys)
    assert (
        "--memory-budget 1: the policy search takes at most 128 layers, not 200 (its family of "
        "policies grows as L^3); pass --layers 2..128, or leave out --memory-budget" in line
    )


def hf_config(tmp_path, **fields):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, **fields}))
    return path


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size", -4, "hidden_size is -4; expected an int >= 1"),
        ("hidden_size", 0, "hidden_size is 0; expected an int >= 1"),
        ("intermediate_size", None, "intermediate_size is null; expected an int >= 1"),
        ("hidden_size", 2.5, "hidden_size is 2.5; expected an int >= 1"),
        ("hidden_size", "64", 'hidden_size is "64"; expected an int >= 1'),
        ("num_attention_heads", 0, "num_attention_heads is 0; expected an int >= 1"),
        ("num_key_value_heads", 0, "num_key_value_heads is 0; expected an int >= 1 or null"),
        (
            "num_key_value_heads",
            3,
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        ),
        ("num_hidden_layers", 700, "the model has 700 layers, and a plan takes at most 512"),
    ],
    ids=["negative", "zero", "null", "fraction", "string", "no-heads", "no-kv", "kv", "deep"],
)
def test_a_config_of_impossible_sizes_is_one_line(tmp_path, capsys, field, value, message):
    path = hf_config(tmp_path, **{field: value})
    line = refused("plan", ["--hf-config", str(path), "--seq", "16"], capsys)
    assert f"--hf-config {path}: {message}" in line


def test_a_device_file_that_is_not_an_object_is_one_line(tmp_path, capsys):
    path = tmp_path / "device.json"
    for content, what in ([1, 2], "the file"), ({"checks": [7]}, "each of 'checks'"):
        path.write_text(json.dumps(content))
        line = refused("plan", ["--preset", "tiny", "--device", str(path)], capsys)
        assert f"--device {path}: DeviceProfile.from_json: {path}: expected {what} to be a" in line


def test_a_config_file_of_another_name_is_the_one_planned(tmp_path, capsys):
    """dir/llama-small.json beside dir/config.json (another model): the file named is read."""
    require("transformers")
    small = hf_config(tmp_path).rename(tmp_path / "llama-small.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 7}))
    assert plan_main(["--hf-config", str(small), "--seq", "16", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert f"LlamaDecoderLayer from {small}: hidden 64" in out
    (tmp_path / "config.json").unlink()  # alone in its folder, it is read all the same
    assert plan_main(["--hf-config", str(small), "--seq", "16"]) == 0
    assert f"LlamaDecoderLayer from {small}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "t.json"], "--trace: needs --simulate PROFILE"),
        (["--memory-budget", "20"], "--memory-budget: needs --simulate PROFILE"),
        (
            ["--simulate", "h100", "--memory-budget", "20,x"],
            "argument --memory-budget: '20,x': expected comma-separated numbers > 0",
        ),
        (["--simulate", "h100", "--device", "cpu"], "--device cpu: --simulate runs on a modeled"),
        (
            ["--simulate", "h100", "--preset", "hooks"],
            "--simulate: models a Llama preset (tiny, llama8b-layer), not --preset hooks",
        ),
    ],
    ids=["trace", "memory-budget", "bad-budget", "device", "hooks"],
)
def test_the_modeled_run_flags_are_refused_before_the_run(argv, message, capsys):
    assert message in refused("bench", argv, capsys)
