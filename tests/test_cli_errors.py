"""Bad input on the command line: one line naming the flag, the value and what is
allowed, exit status 2, no traceback; every tool, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    ("cpu_offload.check", ["--device", "tpu"], "device='tpu' is not a device this offloader"),
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
        from cpu_offload.device import available_device_type

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
