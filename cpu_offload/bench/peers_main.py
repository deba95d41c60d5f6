"""The side-by-side of ``--simulate`` with peer modes (NOTE [Peers on the modeled
accelerator] in peers.py): the table, the JSON's ``"peers"`` list, the trace and the plot."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from typing import Any

import torch

from ..device.profiles import DeviceProfile
from .config import BenchConfig, modeling_line
from .peers import PeerRow, run_peers

__all__ = ["main_peers", "print_peers", "write_peers_plot"]

GIB = 2**30


def print_peers(rows: list[PeerRow], profile_name: str) -> None:
    """The side-by-side table."""
    print(
        f"{'mode':<12} {'step ms':>9} {'peak GiB':>9} {'exposed ms':>11} {'moved GiB':>10} "
        f"{'host GiB':>9} | {'ours ms':>9} {'ours GiB':>9} {'peer/ours':>9}  ours policy"
    )
    for row in rows:
        if row.peer is None or row.ours is None:
            print(f"{row.mode:<12} skipped: {row.skip_reason}")
            continue
        peer, ours = row.peer, row.ours
        print(
            f"{row.mode:<12} {peer.step_s * 1e3:9.2f} {peer.peak_bytes / GIB:9.2f} "
            f"{peer.exposed_copy_s * 1e3:11.2f} "
            f"{(peer.d2h_bytes + peer.h2d_bytes) / GIB:10.2f} "
            f"{peer.host_peak_bytes / GIB:9.2f} | {ours.step_s * 1e3:9.2f} "
            f"{ours.peak_bytes / GIB:9.2f} {peer.step_s / ours.step_s:9.3f}  {row.ours_label}"
            + ("" if ours.peak_bytes <= peer.peak_bytes else " (over the peer's peak)")
        )
    print(
        f"modeled {profile_name}; peak: the model's allocator peak; ours: the planner's policy "
        "for the peer's peak (O offload, C checkpoint, CO both, K keep; peer/ours > 1: ours "
        "is faster)"
    )


def write_peers_plot(path: str, rows: list[PeerRow], title: str) -> str | None:
    """Step time against peak memory, each peer and ours beside it; the reason when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not importable ({error}); pip install 'cpu-offload[bench]'"
    figure, axes = plt.subplots(figsize=(8, 5))
    for row in rows:
        if row.peer is None or row.ours is None:
            continue
        peer, ours = row.peer, row.ours
        points = [
            (peer.peak_bytes / GIB, peer.step_s * 1e3),
            (ours.peak_bytes / GIB, ours.step_s * 1e3),
        ]
        axes.plot(*zip(*points), color="lightgrey", zorder=1)
        axes.scatter(*points[0], marker="o", zorder=2)
        axes.annotate(row.mode, points[0], textcoords="offset points", xytext=(4, 4))
        axes.scatter(*points[1], marker="*", color="black", zorder=3)
    axes.set_xlabel("modeled peak device memory (GiB)")
    axes.set_ylabel("modeled step (ms)")
    axes.set_title(title, fontsize=8)
    figure.text(0.01, 0.01, "circle: the peer's own code; star: ours at that peak", fontsize=8)
    figure.savefig(path, bbox_inches="tight")
    plt.close(figure)
    return None


def main_peers(config: BenchConfig, profile: DeviceProfile, command: str) -> int:
    """``--simulate`` with ``--modes`` of peers only: run them, print, write."""
    print(
        modeling_line(
            profile.name, profile.runtime, config, "shapes only; the peers' own code beside ours"
        ),
        flush=True,
    )
    began = time.perf_counter()

    def progress(row: PeerRow) -> None:
        print(f"modeled {row.mode} and ours ({time.perf_counter() - began:.1f} s)", flush=True)

    record = bool(config.trace or config.plot)
    rows = run_peers(config, str(config.simulate), config.modes, progress, record)
    print()
    print_peers(rows, profile.name)
    if config.json:
        document: dict[str, Any] = {
            "environment": {
                "device": "modeled",
                "device_name": f"modeled {profile.name}",
                "torch": torch.__version__,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "command": command,
            },
            "config": dataclasses.asdict(config),
            "profile": dataclasses.asdict(profile),
            "peers": [row.as_json() for row in rows],
        }
        with open(config.json, "w") as handle:
            json.dump(document, handle, indent=2)
        print(f"figures written to {config.json}")
    if config.trace:
        from ..testing.trace import write_trace

        runs = []
        for row in rows:
            if row.peer is not None and row.ours is not None:
                runs += [(row.mode, row.peer), (f"ours at {row.mode}'s peak", row.ours)]
        write_trace(config.trace, runs)
        print(f"trace written to {config.trace} (open it in https://ui.perfetto.dev)")
    if config.plot:
        reason = write_peers_plot(config.plot, rows, f"modeled {profile.name}: {command}")
        print(f"plot not written: {reason}" if reason else f"plot written to {config.plot}")
    return 0
