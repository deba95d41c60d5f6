"""The benchmark's table, JSON file and plot."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .measure import ModeResult

__all__ = ["print_table", "write_json", "write_plot"]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


def print_table(results: list[ModeResult], ceiling: dict[str, float]) -> None:
    header = (
        f"{'mode':<13} {'median ms':>10} {'min-max ms':>15} {'overhead':>9} "
        f"{'end-fwd MiB':>11} {'analytic':>9} {'peak MiB':>9} {'MiB/step':>9} "
        f"{'D2H GB/s':>9} {'H2D GB/s':>9} {'pin alloc':>9} {'syncs':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if r.skipped:
            print(f"{r.mode:<13} skipped: {r.skipped}")
            continue
        spread = f"{r.spread_ms[0]:.1f}-{r.spread_ms[1]:.1f}" if r.spread_ms else "-"
        overhead = "-" if r.overhead_pct is None else f"{r.overhead_pct:+.1f}%"
        analytic = "-"
        if r.analytic_end_of_forward_bytes and r.end_of_forward_bytes is not None:
            analytic = f"{100 * r.end_of_forward_bytes / r.analytic_end_of_forward_bytes:.0f}%"
        pinned = (
            "-" if r.pinned_allocations_per_step is None else f"{r.pinned_allocations_per_step:g}"
        )
        syncs = "-" if r.host_syncs_per_step is None else f"{r.host_syncs_per_step:g}"
        moved = None if r.bytes_offloaded_per_step is None else r.bytes_offloaded_per_step
        print(
            f"{r.mode:<13} {r.median_step_ms:>10.1f} {spread:>15} {overhead:>9} "
            f"{_mib(r.end_of_forward_bytes):>11} {analytic:>9} {_mib(r.peak_bytes):>9} "
            f"{_mib(moved):>9} {_gbps(r.d2h_bytes_per_s):>9} {_gbps(r.h2d_bytes_per_s):>9} "
            f"{pinned:>9} {syncs:>6}"
        )
    print(
        f"raw copy ceiling: D2H {_gbps(ceiling.get('d2h'))} GB/s, "
        f"H2D {_gbps(ceiling.get('h2d'))} GB/s"
    )


def write_json(
    path: str,
    environment: dict[str, Any],
    config: Any,
    results: list[ModeResult],
    ceiling: dict[str, float],
) -> None:
    document = {
        "environment": environment,
        "config": dataclasses.asdict(config),
        "ceiling_bytes_per_s": ceiling,
        "modes": [dataclasses.asdict(r) for r in results],
    }
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)


def write_plot(path: str, results: list[ModeResult], title: str) -> str | None:
    """Memory at every layer boundary per mode, and overhead against memory saved.

    Returns why no plot was written, or ``None``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'cpu-offload[bench]')"
    ran = [r for r in results if not r.skipped]
    figure, (memory, pareto) = plt.subplots(1, 2, figsize=(13, 5))
    for r in ran:
        points = [m for _, _, m in r.memory_trace if m is not None]
        if points and len(points) == len(r.memory_trace):
            memory.plot([p / 2**20 for p in points], marker=".", label=r.mode)
    if memory.lines:
        memory.set_xlabel("layer boundary (forward, then backward)")
        memory.set_ylabel("allocated device memory (MiB)")
        memory.set_title("(a) device memory through a step")
        memory.legend(fontsize=8)
    else:  # a device that reports no memory (the CPU): what was measured instead
        timed = [r for r in ran if r.median_step_ms is not None]
        memory.bar([r.mode for r in timed], [r.median_step_ms or 0.0 for r in timed])
        for index, r in enumerate(timed):
            if r.spread_ms is not None:
                low, high = r.spread_ms
                memory.plot([index, index], [low, high], color="black")
        memory.set_ylabel("step time (ms): median, min-max")
        memory.set_title("(a) step time per mode (this device reports no memory)")
        memory.tick_params(axis="x", labelrotation=30, labelsize=8)
    pareto_memory = any(r.memory_saved_bytes is not None for r in ran)
    for r in ran:
        saved = r.memory_saved_bytes if pareto_memory else r.bytes_offloaded_per_step
        if r.overhead_pct is not None and saved is not None:
            pareto.scatter(saved / 2**20, r.overhead_pct)
            pareto.annotate(r.mode, (saved / 2**20, r.overhead_pct), fontsize=8)
    pareto.axhline(0.0, color="grey", linewidth=0.5)
    if pareto_memory:
        pareto.set_xlabel("memory saved at the end of forward (MiB)")
        pareto.set_title("(b) overhead against memory saved")
    else:
        pareto.set_xlabel("MiB moved to the host per step")
        pareto.set_title("(b) overhead against bytes moved (this device reports no memory)")
    pareto.set_ylabel("step-time overhead vs none (%)")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
