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

from .device.amounts import parse_flag_bytes

__all__ = [
    "Parser",
    "at_least",
    "device",
    "fraction",
    "int_in",
    "int_list",
    "memory_amount",
    "memory_amount_list",
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


def memory_amount(flag: str) -> Callable[[str], int]:
    """An argparse type: an amount of memory > 0 as bytes; a bare number is GiB (``20``,
    ``0.5``), a string with a unit what it says (``512MiB``, ``0.01GiB``, ``20GB``):
    :func:`cpu_offload.device.amounts.parse_flag_bytes`."""

    expected = "an amount of memory > 0: GiB (20, 0.5) or a size with its unit (512MiB)"

    def parse(text: str) -> int:
        try:
            value = parse_flag_bytes(text, flag)
        except ValueError:
            value = 0
        if value <= 0:
            _flag_error(expected)(text)
        return value

    parse.__name__ = "an amount of memory"
    return parse


def memory_amount_list(flag: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated :func:`memory_amount` (``10,20.5,512MiB``)."""
    one = memory_amount(flag)

    def parse(text: str) -> list[int]:
        try:
            return [one(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            _flag_error(
                "comma-separated amounts of memory > 0: GiB (20, 0.5) or sizes with their "
                "unit (512MiB)"
            )(text)

    parse.__name__ = "amounts of memory"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a fraction >= 0, as a number up to 1 (``0.05``) or a percentage
    (``5%``); a bare number above 1 is refused (``5`` would be 500%)."""
    stripped = text.strip()
    percent = stripped.endswith("%")
    try:
        value = float(stripped.removesuffix("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        _flag_error("a fraction >= 0, such as 0.02 or 2%")(text)
    if percent:
        return value / 100
    if value > 1:
        _flag_error(
            f"a fraction up to 1 (0.02 is 2%) or a percentage such as {stripped}%; a bare "
            f"{stripped} would mean {value:.0%}: write {value * 100:g}% if you mean that"
        )(text)
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
