"""A modeled run as a timeline users can open: Chrome trace JSON (``chrome://tracing``,
https://ui.perfetto.dev).

Each run is a process; its tracks are the host (its stalls), each stream (kernels, copies,
waits) and a counter of device memory.  Consecutive kernels of one phase of the step
(``TimedReport.begin``) form one slice, named for the phase, unless ``kernels=True``;
consecutive copies of one direction and phase form one slice too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .clocks import StreamClock
from .timed_report import TimedReport

__all__ = ["trace_events", "write_trace"]

GIB = 2**30
MIB = 2**20
_US = 1e6  # the trace counts microseconds
_MAX_COUNTER_POINTS = 2000


def _name(what: Any) -> str:
    return getattr(what, "__name__", None) or str(what)


def _stream_slices(stream: StreamClock, kernels: bool) -> list[tuple[float, float, str, str]]:
    """``(start, end, name, category)`` of the stream's work, merged as the module says."""
    merged: list[list[Any]] = []  # [start, end, name, category, bytes]
    for start, end, kind, what, phase in stream.log:
        if kind == "kernel":
            name = _name(what) if kernels or not phase else phase
        elif kind == "wait":
            name = str(what)
        else:
            name = f"{kind.upper()} {phase}".strip()
        last = merged[-1] if merged else None
        joins = kind != "wait" and not (kind == "kernel" and kernels)
        if joins and last is not None and last[2:4] == [name, kind] and start - last[1] < 1e-9:
            last[1] = end
        else:
            merged.append([start, end, name, kind, 0])
        if kind in ("d2h", "h2d", "d2d"):
            merged[-1][4] += int(what)
    return [
        (start, end, f"{name}, {moved / MIB:.0f} MiB" if moved else name, kind)
        for start, end, name, kind, moved in merged
    ]


def _counter(curve: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The memory curve thinned to at most a few thousand points, keeping each bin's peak."""
    if len(curve) <= _MAX_COUNTER_POINTS:
        return curve
    step = len(curve) / _MAX_COUNTER_POINTS
    thinned = []
    for index in range(_MAX_COUNTER_POINTS):
        chunk = curve[int(index * step) : int((index + 1) * step)]
        if chunk:
            thinned.append(max(chunk, key=lambda point: point[1]))
    return thinned


def trace_events(
    report: TimedReport, name: str = "modeled run", pid: int = 0, kernels: bool = False
) -> list[dict[str, Any]]:
    """The Chrome trace events of one run, as process ``pid`` named ``name``."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "host"}},
    ]
    for start, end, what in report.host_log:
        events.append(_slice(pid, 0, start, end, f"host waits: {what}", "sync"))
    for tid, stream in enumerate(report.streams, start=1):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"name": stream.name},
            }
        )
        for start, end, label, category in _stream_slices(stream, kernels):
            events.append(_slice(pid, tid, start, end, label, category))
    for time, allocated in _counter(report.curve):
        events.append(
            {
                "name": "device memory",
                "ph": "C",
                "pid": pid,
                "ts": time * _US,
                "args": {"GiB": round(allocated / GIB, 4)},
            }
        )
    for mark in report.marks:
        events.append(
            {
                "name": mark.label,
                "ph": "i",
                "s": "p",
                "pid": pid,
                "tid": 1,
                "ts": mark.time * _US,
                "args": {"counted GiB": round(mark.counted / GIB, 4)},
            }
        )
    return events


def _slice(pid: int, tid: int, start: float, end: float, name: str, category: str) -> dict:
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * _US,
        "dur": max(end - start, 0.0) * _US,
    }


def write_trace(
    path: str | Path, runs: Sequence[tuple[str, TimedReport]], kernels: bool = False
) -> None:
    """Write ``runs`` (``(name, report)`` each) as one Chrome trace JSON file, a process
    per run; ``kernels``: a slice per kernel instead of one per phase."""
    events: list[dict[str, Any]] = []
    for pid, (name, report) in enumerate(runs):
        events.extend(trace_events(report, name, pid, kernels))
    with open(path, "w") as file:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, file)
