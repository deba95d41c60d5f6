"""Counting the host cost of the hooks in instructions, repeatably on a loaded machine.

Wall time on a shared machine swings several-fold from run to run; the number of
instructions a step executes does not.  ``--count instructions`` runs the hooks preset
under valgrind's callgrind, collecting only around the measured steps of each mode
(``torch._C._valgrind_toggle``, callgrind's client request), one dump per mode, and
reads the dumps' totals back.  Without valgrind it falls back to the CPU time of the
measuring thread (``time.thread_time_ns``), which ignores other processes but not the
machine's speed.

The measuring process is the same command re-run under valgrind with
:data:`ENV_OUT` set to a folder: there it measures each mode in turn and writes
``modes.json``; the calling process reads ``modes.json`` and the dumps
``callgrind.out.<n>`` (one per mode, in order).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ENV_OUT",
    "ModeCount",
    "callgrind_available",
    "count_under_callgrind",
    "read_totals",
]

#: set in the measuring process: the folder its dumps and ``modes.json`` go to
ENV_OUT = "CPU_OFFLOAD_CALLGRIND_OUT"


@dataclass
class ModeCount:
    """What one mode cost per step, in ``unit`` (instructions or ns of CPU time)."""

    mode: str
    steps: int
    tensors_per_step: int
    per_step: float = 0.0
    layers: int = 0  # the layers the per-layer modes divide by


def callgrind_available() -> bool:
    """Whether valgrind is installed and torch can toggle callgrind's collection."""
    return shutil.which("valgrind") is not None and bool(
        torch._C._valgrind_supported_platform()  # type: ignore[attr-defined]
    )


def read_totals(path: str) -> int:
    """The instructions a callgrind dump counted (its ``totals:`` line)."""
    with open(path) as file:
        for line in file:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise ValueError(f"{path}: no totals line; is it a callgrind dump?")


class Collector:
    """Brackets the measured steps of one mode: callgrind's toggles, or thread time."""

    def __init__(self, under_callgrind: bool) -> None:
        self.under_callgrind = under_callgrind
        self._start = 0

    def start(self) -> None:
        if self.under_callgrind:
            torch._C._valgrind_toggle()  # type: ignore[attr-defined]
        else:
            self._start = time.thread_time_ns()

    def stop(self) -> float:
        """The thread time since :meth:`start` (0 under callgrind: the dump has it)."""
        if self.under_callgrind:
            torch._C._valgrind_toggle_and_dump_stats()  # type: ignore[attr-defined]
            return 0.0
        return float(time.thread_time_ns() - self._start)


def count_under_callgrind(argv: Sequence[str], read_modes: Callable[[str], list[ModeCount]]):
    """Re-run this command under callgrind; the count per step of every mode."""
    with tempfile.TemporaryDirectory(prefix="cpu_offload_callgrind_") as folder:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--callgrind-out-file={os.path.join(folder, 'callgrind.out')}",
            sys.executable,
            "-m",
            "cpu_offload.bench",
            *argv,
        ]
        print(f"running under callgrind (a minute or more): {' '.join(command[:4])} ...")
        sys.stdout.flush()
        result = subprocess.run(
            # A fixed hash seed: dictionaries lay out the same way, so counts repeat.
            command,
            env={**os.environ, ENV_OUT: folder, "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"the run under callgrind failed (exit {result.returncode}):\n"
                f"{result.stderr[-2000:]}"
            )
        modes = read_modes(folder)
        for index, mode in enumerate(modes, start=1):
            total = read_totals(os.path.join(folder, f"callgrind.out.{index}"))
            mode.per_step = total / mode.steps
        return modes


def write_modes(folder: str, modes: list[ModeCount]) -> None:
    with open(os.path.join(folder, "modes.json"), "w") as file:
        json.dump([vars(m) for m in modes], file)


def load_modes(folder: str) -> list[ModeCount]:
    with open(os.path.join(folder, "modes.json")) as file:
        return [ModeCount(**m) for m in json.load(file)]
