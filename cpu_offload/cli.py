"""What the command-line tools share: bad input becomes one line and exit status 2.

Every tool (``python -m cpu_offload``, ``.plan``, ``.bench``, ``.check``) builds its
parser with :class:`Parser` and its numbers with the types below, so a wrong flag reads
``prog: error: --seq -5: expected an int >= 1`` rather than a traceback from deep inside.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "Parser",
    "at_least",
    "device",
    "int_in",
    "int_list",
    "output_file",
    "plot_file",
    "positive_float",
    "positive_float_list",
]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _flag_error(expected: str) -> Callable[[str], NoReturn]:
    def fail(text: str) -> NoReturn:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")

    return fail


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int ``>= minimum``."""
    expected = f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            _flag_error(expected)(text)
        if value < minimum:
            _flag_error(expected)(text)
        return value

    parse.__name__ = expected  # argparse names the type in some messages
    return parse


def int_in(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an int in ``minimum..maximum``."""
    expected = f"an int in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            _flag_error(expected)(text)
        if not minimum <= value <= maximum:
            _flag_error(expected)(text)
        return value

    parse.__name__ = expected
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        _flag_error("a number > 0")(text)
    if not value > 0 or value == float("inf"):
        _flag_error("a number > 0")(text)
    return value


def positive_float_list(text: str) -> list[float]:
    """An argparse type: comma-separated finite floats > 0 (``10,20.5``)."""
    values = []
    for part in text.split(","):
        try:
            values.append(positive_float(part.strip()))
        except argparse.ArgumentTypeError:
            _flag_error("comma-separated numbers > 0, such as 10,20")(text)
    return values


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated ints ``>= minimum`` (``1,2,3``)."""
    expected = f"comma-separated ints >= {minimum}, such as 1,2,3"

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            _flag_error(expected)(text)
        if not values or any(v < minimum for v in values):
            _flag_error(expected)(text)
        return values

    return parse


def device(text: str) -> str:
    """An argparse type: a device this package can use and this machine has."""
    from .device.runtime import get_backend

    try:
        get_backend(text)
    except (ValueError, RuntimeError) as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("cpu_offload: ")) from None
    return text


def output_file(text: str) -> str:
    """An argparse type: a path a file can be written to (checked before any run, so that
    a long run does not end in an unwritable path): in an existing folder that may be
    written to, and not a folder itself."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        _flag_error("a file name, not a folder")(text)
    if not os.path.isdir(folder):
        _flag_error(f"a path in an existing folder ({folder!r} does not exist: create it first)")(
            text
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        _flag_error(f"a path in a folder you may write to (not {folder!r})")(text)
    return text


def plot_formats() -> list[str] | None:
    """The file name endings matplotlib can write (``png``, ``pdf``, ...), or None
    without matplotlib."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_file(text: str) -> str:
    """An argparse type: :func:`output_file` whose name ends in a format matplotlib
    writes (without matplotlib, any ending: the tool then says it is missing)."""
    output_file(text)
    formats = plot_formats()
    ending = os.path.splitext(text)[1].lower().removeprefix(".")
    if formats is not None and ending not in formats:
        allowed = ", ".join(f".{f}" for f in formats)
        _flag_error(f"a file name ending in one of {allowed}")(text)
    return text
