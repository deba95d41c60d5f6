"""``--simulate``'s table, JSON and plot: the modeled figures beside the predicted ones."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

from ..device.profiles import DeviceProfile
from .simulate import SimulatedRow, Simulation

__all__ = [
    "agreement",
    "print_simulation",
    "shown_row",
    "write_simulation_json",
    "write_simulation_plot",
]

GIB = 2**30


def _difference(modeled: float, predicted: float) -> float:
    """``modeled`` against ``predicted``, as a fraction (0 where both are 0)."""
    if predicted == 0:
        return 0.0 if modeled == 0 else float("inf")
    return modeled / predicted - 1


def agreement(simulation: Simulation) -> dict[str, Any]:
    """The worst step-time and peak differences over the rows, and where."""
    L = simulation.layers
    worst: dict[str, Any] = {}
    for key, modeled, predicted in (
        ("step", lambda r: r.modeled.step_s, lambda r: r.predicted.step_s),
        ("peak", lambda r: r.modeled_peak_bytes, lambda r: r.predicted.peak_bytes),
        (
            "end_of_forward",
            lambda r: r.modeled_end_of_forward_bytes(L),
            lambda r: r.predicted.end_of_forward_bytes,
        ),
    ):
        row = max(simulation.rows, key=lambda r: abs(_difference(modeled(r), predicted(r))))
        worst[f"worst_{key}_difference"] = _difference(modeled(row), predicted(row))
        worst[f"worst_{key}_row"] = row.label
    return worst


def print_simulation(simulation: Simulation, profile: DeviceProfile) -> None:
    print(
        f"modeled: {profile.name} ({profile.source}), {profile.runtime} runtime, shapes only; "
        "predicted: the planner's event model of the same layer"
    )
    header = (
        f"{'row':<32} {'step ms model':>13} {'plan':>9} {'diff':>7} {'overhead':>8} "
        f"{'plan':>7} {'exposed ms':>10} {'plan':>8} {'diff':>7} {'peak GiB':>9} {'plan':>8} "
        f"{'diff':>7} {'end-fwd GiB':>11} {'plan':>8} {'diff':>7}"
    )
    print(header)
    print("-" * len(header))
    baseline = simulation.baseline.modeled.step_s
    L = simulation.layers
    for row in simulation.rows:
        m, p = row.modeled, row.predicted
        end = row.modeled_end_of_forward_bytes(L)
        print(
            f"{row.label:<32} {m.step_s * 1e3:>13.2f} {p.step_s * 1e3:>9.2f} "
            f"{_difference(m.step_s, p.step_s):>+7.2%} {m.step_s / baseline - 1:>+8.1%} "
            f"{p.overhead:>+7.1%} {m.exposed_copy_s * 1e3:>10.2f} {p.exposed_copy_s * 1e3:>8.2f} "
            f"{(m.exposed_copy_s - p.exposed_copy_s) * 1e3:>+7.2f} "
            f"{row.modeled_peak_bytes / GIB:>9.3f} {p.peak_bytes / GIB:>8.3f} "
            f"{_difference(row.modeled_peak_bytes, p.peak_bytes):>+7.2%} "
            f"{end / GIB:>11.3f} {p.end_of_forward_bytes / GIB:>8.3f} "
            f"{_difference(end, p.end_of_forward_bytes):>+7.2%}"
        )
    worst = agreement(simulation)
    print(
        f"agreement over {len(simulation.rows)} rows: step time within "
        f"{abs(worst['worst_step_difference']):.2%} ({worst['worst_step_row']}), peak within "
        f"{abs(worst['worst_peak_difference']):.2%} ({worst['worst_peak_row']}), end of forward "
        f"within {abs(worst['worst_end_of_forward_difference']):.2%}"
    )
    print(
        "exposed diff in ms; peak: device memory at layer boundaries less the hidden state "
        "handed on and gradients (the planner's count); the model's allocator peak, "
        "everything included, is in the JSON (modeled_device_peak_bytes)"
    )


def write_simulation_json(
    path: str,
    simulation: Simulation,
    profile: DeviceProfile,
    environment: dict[str, Any],
    config: Any,
) -> None:
    L = simulation.layers
    baseline = simulation.baseline.modeled.step_s
    layer = dataclasses.asdict(simulation.layer)
    for key in ("saved", "forward_kernels", "backward_kernels", "recompute_kernels", "following"):
        layer.pop(key)
    document = {
        "environment": environment,
        "config": dataclasses.asdict(config),
        "profile": dataclasses.asdict(profile),
        "layer": layer,
        "simulated": [row.as_json(L, baseline) for row in simulation.rows],
        "agreement": agreement(simulation),
    }
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)


def _timeline(axes: Any, row: SimulatedRow) -> None:
    """Compute, D2H and H2D lanes of one row, and its device memory."""
    report = row.modeled
    lanes = {"compute": 2, "d2h": 1, "h2d": 0}
    colours = {"kernel": "tab:blue", "wait": "tab:red", "d2h": "tab:orange", "h2d": "tab:green"}
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for stream in report.streams:
        for start, end, kind, _, _ in stream.log:
            lane = "compute" if stream.is_compute else kind
            if lane in lanes and kind != "d2d":
                bars.setdefault((lane, kind), []).append((start * 1e3, (end - start) * 1e3))
    for (lane, kind), spans in bars.items():
        axes.broken_barh(
            spans, (lanes[lane] - 0.4, 0.8), facecolors=colours.get(kind, "grey"), linewidth=0
        )
    axes.set_yticks(list(lanes.values()), ["compute stream", "D2H copies", "H2D copies"])
    axes.set_xlabel("modeled time (ms); red: compute waits for a copy; dashed: end of forward")
    axes.set_title(f"(c) {row.label}: the streams and device memory", fontsize=10)
    memory = axes.twinx()
    times = [t * 1e3 for t, _ in report.curve]
    memory.plot(
        times,
        [b / GIB for _, b in report.curve],
        color="black",
        linewidth=0.8,
        label="allocated (gradients, temporaries included)",
    )
    memory.plot(
        [m.time * 1e3 for m in report.marks],
        [m.counted / GIB for m in report.marks],
        ".",
        color="purple",
        markersize=3,
        label="activations at layer boundaries (the planner's count)",
    )
    ends = [m.time * 1e3 for m in report.marks if m.label.startswith("forward")]
    if ends:
        axes.axvline(max(ends), color="grey", linestyle="--", linewidth=0.8)
    memory.set_ylabel("device memory (GiB)")
    memory.set_ylim(bottom=0)
    memory.legend(fontsize=7, loc="upper right")


def shown_row(simulation: Simulation) -> SimulatedRow:
    """The row whose timeline the plot draws: the largest k within 10% of the step
    without offload (copies partly exposed: the overlap and its limit both show)."""
    baseline = simulation.baseline.modeled.step_s
    k_rows = [r for r in simulation.rows if r.policy is None]
    within = [r for r in k_rows if r.modeled.step_s <= 1.1 * baseline]
    return max(within or k_rows, key=lambda r: r.k)


def write_simulation_plot(path: str, simulation: Simulation, title: str) -> str | None:
    """(a) step time and (b) peak per row, modeled and predicted; (c) the timeline of one
    row (:func:`shown_row`).  Returns why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'cpu-offload[bench]')"
    rows = simulation.rows
    figure = plt.figure(figsize=(13, 8))
    step, peak = figure.add_subplot(2, 2, 1), figure.add_subplot(2, 2, 2)
    positions = list(range(len(rows)))
    panels = (
        (step, [r.modeled.step_s * 1e3 for r in rows], [r.predicted.step_s * 1e3 for r in rows],
         "step time (ms)", "(a) step time"),
        (peak, [r.modeled_peak_bytes / GIB for r in rows],
         [r.predicted.peak_bytes / GIB for r in rows], "peak activations (GiB)",
         "(b) peak memory"),
    )  # fmt: skip
    for axes, modeled, predicted, unit, name in panels:
        axes.plot(positions, modeled, "o", label="modeled (the code)", markersize=5)
        axes.plot(positions, predicted, "x", label="predicted (the planner)", markersize=7)
        axes.set_ylabel(unit)
        axes.set_title(name, fontsize=10)
        axes.set_xticks(positions, [r.label.split(":")[0] for r in rows], rotation=90, fontsize=6)
        axes.legend(fontsize=8)
    _timeline(figure.add_subplot(2, 1, 2), shown_row(simulation))
    figure.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
