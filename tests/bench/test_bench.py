"""The benchmark as a CPU smoke test: every mode runs and every figure is reported."""

from __future__ import annotations

import contextlib
import importlib.util
import json

import pytest
import torch

from cpu_offload.bench import main
from cpu_offload.bench.config import parse_args
from cpu_offload.bench.modes import make_mode
from cpu_offload.device.runtime import get_backend
from cpu_offload.report.copy_timer import CopyTimer
from cpu_offload.testing import strict_streams

SMALL = [
    "--layers",
    "3",
    "--offload",
    "1,2",
    "--seq",
    "256",
    "--hidden",
    "128",
    "--ffn",
    "256",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--warmup",
    "1",
    "--steps",
    "2",
    "--min-offload-numel",
    "0",
    "--ceiling-mib",
    "8",
]
FIGURES = [
    "median_step_ms",
    "spread_ms",
    "overhead_pct",
    "peak_bytes",
    "end_of_forward_bytes",
    "bytes_offloaded_per_step",
    "d2h_bytes_per_s",
    "h2d_bytes_per_s",
    "pinned_allocations_per_step",
    "host_syncs_per_step",
    "memory_trace",
    "analytic_end_of_forward_bytes",
    "memory_saved_bytes",
]


def test_smoke_run_reports_every_figure(tmp_path, capsys, monkeypatch):
    threads = torch.get_num_threads()
    drawn: list[str] = []
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.axes

        # What the plot shows on a CPU, which reports no memory: what was measured.
        monkeypatch.setattr(
            matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: drawn.append(t)
        )
    report, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    try:
        assert main([*SMALL, "--json", str(report), "--plot", str(plot)]) == 0
        assert torch.get_num_threads() == 1  # one intra-op thread on a CPU by default
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "torch intra-op threads: 1 (--threads)" in out
    if drawn:
        assert drawn == [
            "(a) step time per mode (this device reports no memory)",
            "(b) overhead against bytes moved (this device reports no memory)",
        ]
    assert "raw copy ceiling" in out and "measuring 2 interleaved steps per mode" in out
    document = json.loads(report.read_text())
    assert document["environment"]["torch"] == torch.__version__
    assert set(document["ceiling_bytes_per_s"]) == {"d2h", "h2d"}
    assert all(v > 0 for v in document["ceiling_bytes_per_s"].values())
    modes = {m["mode"]: m for m in document["modes"]}
    assert list(modes) == [
        "none",
        "offload:1",
        "offload:2",
        "save_on_cpu",
        "checkpoint",
        "torchtune",
    ]
    for name, figures in modes.items():
        assert all(key in figures for key in FIGURES), name
        if figures["skipped"]:
            assert name == "torchtune" and "torchtune" in figures["skipped"]
            continue
        assert len(figures["step_ms"]) == 2 and figures["median_step_ms"] > 0
        assert len(figures["memory_trace"]) == 2 * 3  # forward and backward boundaries
    for name in ("offload:1", "offload:2"):
        figures = modes[name]
        assert figures["bytes_offloaded_per_step"] > 0
        assert figures["d2h_bytes_per_s"] > 0 and figures["h2d_bytes_per_s"] > 0
        assert figures["pinned_allocations_per_step"] == 0  # buffers reused, unasked
    assert (
        modes["offload:2"]["bytes_offloaded_per_step"]
        > modes["offload:1"]["bytes_offloaded_per_step"]
    )
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offload_modes_run_clean_under_strict_streams(capsys):
    with strict_streams() as sim:
        assert main([*SMALL, "--modes", "none,offload"]) == 0
    assert sim.counters.hazards == 0 and sim.counters.copies_run > 0


def test_bad_arguments():
    with pytest.raises(SystemExit):
        parse_args(["--layers", "3", "--offload", "3"])
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        make_mode("fast", 3, get_backend("cpu"), 0)


def test_presets():
    config = parse_args(["--preset", "llama8b-layer"])
    assert (
        config.hidden,
        config.heads,
        config.kv_heads,
        config.ffn,
        config.seq,
        config.batch,
        config.dtype,
    ) == (4096, 32, 8, 14336, 4096, 1, "bf16")
    assert config.layers >= 8 and config.modes[:2] == ["none", "offload:1"]


def test_copy_timer():
    backend = get_backend("cpu")
    timer = CopyTimer(backend)
    assert timer.bandwidth("d2h") is None
    stream = backend.new_stream()
    start = timer.start(stream)
    torch.empty(1 << 20).copy_(torch.ones(1 << 20))
    timer.stop("d2h", 4 << 20, start, stream)
    assert timer.totals("d2h")[0] == 4 << 20 and timer.bandwidth("d2h") > 0
    timer.reset()
    assert timer.spans == []


def test_save_on_cpu_baseline_pins_for_the_backend_device_type(monkeypatch):
    from types import SimpleNamespace

    from cpu_offload.bench import modes

    calls = []

    def recorder(pin_memory: bool = False, device_type: str = "cuda"):
        calls.append((pin_memory, device_type))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", recorder)
    modes.save_on_cpu(SimpleNamespace(pin_memory=True, device_type="npu"))
    assert calls == [(True, "npu")]


def test_hooks_preset_reports_the_cost_per_tensor(tmp_path, capsys):
    report = tmp_path / "hooks.json"
    args = ["--preset", "hooks", "--layers", "3", "--steps", "2", "--warmup", "1"]
    assert main([*args, "--json", str(report)]) == 0
    assert "vs save_on_cpu" in capsys.readouterr().out
    modes = {m["mode"]: m for m in json.loads(report.read_text())["modes"]}
    assert list(modes) == ["none", "hooks:stay", "hooks:move", "save_on_cpu", "copy_hooks"]
    # 3 layers of 4 (Linear, GELU, LayerNorm) blocks save 32 tensors each; hooks on 2.
    assert modes["hooks:stay"]["tensors_per_step"] == 2 * 32
    assert modes["save_on_cpu"]["tensors_per_step"] == 3 * 32
    assert modes["hooks:move"]["tensors_per_step"] == 2 * 4 * 5  # inputs, mean, rstd
    assert all(len(m["step_ms"]) == 2 for m in modes.values())
    # The ratio's value is a timing (tests read a ticking clock: NOTE in conftest.py); its
    # field is there, a number or None where a cost does not come out positive.
    ratio = modes["hooks:move"]["ratio_to_save_on_cpu"]
    assert ratio is None or ratio > 0


def test_torchtune_row_is_skipped_off_cuda_with_the_reason():
    mode = make_mode("torchtune", 3, get_backend("cpu"), 0)
    assert mode.skip_reason == "torchtune's OffloadActivations needs CUDA, not cpu"


def test_instruction_counts_fall_back_to_thread_time_without_valgrind(
    capsys, monkeypatch, tmp_path
):
    import sys

    import cpu_offload.bench.main  # noqa: F401 - the module, not the function

    bench_main = sys.modules["cpu_offload.bench.main"]
    monkeypatch.setattr(bench_main, "callgrind_available", lambda: False)
    threads = torch.get_num_threads()
    report = tmp_path / "counts.json"
    try:
        argv = ["--preset", "hooks", "--layers", "3", "--count", "instructions"]
        assert main([*argv, "--json", str(report)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "valgrind not found: counting CPU time of this thread instead (ns)" in out
    document = json.loads(report.read_text())
    modes = {m["mode"]: m for m in document["modes"]}
    assert document["unit"] == "ns"
    assert list(modes) == [
        "none", "empty_hooks", "hooks:stay", "hooks:move", "save_on_cpu", "copy_hooks",
        "layers:none", "layers:hooks",
    ]  # fmt: skip
    assert all(m["per_step"] > 0 for m in modes.values())
    assert modes["hooks:move"]["tensors_per_step"] > 0 and modes["none"]["tensors_per_step"] == 0
    assert modes["layers:hooks"]["layers"] == 3
    assert "fixed cost per layer: " in out and " ns (layers that save nothing" in out


def test_callgrind_totals_are_read_from_a_dump(tmp_path):
    from cpu_offload.bench.counting import read_totals

    dump = tmp_path / "callgrind.out.1"
    dump.write_text(
        "version: 1\ncmd: python\npart: 1\nevents: Ir\nsummary: 795668\ntotals: 795668\n"
    )
    assert read_totals(str(dump)) == 795668
    (tmp_path / "empty").write_text("version: 1\n")
    with pytest.raises(ValueError, match="no totals line"):
        read_totals(str(tmp_path / "empty"))


def test_counting_instructions_needs_the_hooks_preset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--count", "instructions"])
    assert exit_info.value.code == 2
    assert "--count instructions: counts the hooks preset only" in capsys.readouterr().err


def test_every_flag_of_bench_help_says_what_it_does_and_its_default():
    from cpu_offload.bench.config import _parser

    actions = [a for a in _parser()._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in actions), [a.dest for a in actions if not a.help]
    defaults = [a for a in actions if a.default not in (None, False) and a.dest != "threads"]
    assert all("default" in a.help for a in defaults), [a.dest for a in defaults]
    (preset,) = [a for a in actions if a.dest == "preset"]
    assert "default tiny: 4 Llama layers of hidden 256 at seq 512, fp32" in preset.help
