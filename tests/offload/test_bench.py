"""The benchmark as a CPU smoke test: every mode runs and every figure is reported."""

from __future__ import annotations

import json

import pytest
import torch

from cpu_offload.bench import main
from cpu_offload.bench.config import parse_args
from cpu_offload.bench.modes import make_mode
from cpu_offload.copy_timer import CopyTimer
from cpu_offload.device import get_backend
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


def test_smoke_run_reports_every_figure(tmp_path, capsys):
    report, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main([*SMALL, "--json", str(report), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "raw copy ceiling" in out and "[6/6] torchtune" in out
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
