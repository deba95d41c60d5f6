"""An amount of memory: one meaning for ``memory_budget=``, ``max_host_bytes=`` and the
command-line flags that take one.

In the API an amount is a number of bytes (an int, a NumPy integer, or a whole float)
or a string with its unit (``"20GiB"``, ``"20G"``, ``"512MiB"``, ``"1.5GB"``, ``"4096B"``,
``"1e9"``).  One rule for units, case and spaces ignored: KiB/MiB/GiB/TiB and the bare
letters K/M/G/T (and Ki/Mi/Gi/Ti) are powers of 1024, as Slurm's ``--mem=20G`` and
``free -h`` write them; kB/MB/GB/TB are powers of 1000; B is bytes.  A number in a
string is what the same number is outside one (``"1e9"`` is ``1e9``), and an integer
of any integer type (a NumPy integer too) is an int, here and for every count the API
takes (``keep_passes=``, ``reload_slice_bytes=``).
A number under :data:`MIN_BARE_BYTES` (1 MiB) other than 0 is refused: ``20`` is far
more likely meant as 20 GiB than as 20 bytes, so the message says the unit is bytes and
suggests ``"20GiB"``; a string says its unit, and any size may be written so.  A
fractional count of bytes is refused too (a unit above bytes rounds down to whole
bytes: ``"0.01GiB"`` is 10737418 bytes).

On the command line a bare number is GiB, as each flag's help says (``--memory-budget
20``), and a string with a unit is what it says (``--memory-budget 512MiB``):
:func:`parse_flag_bytes`.
"""

from __future__ import annotations

import math
import numbers
import re

__all__ = [
    "AUTO",
    "FORMS",
    "MIN_BARE_BYTES",
    "UNITS",
    "integer",
    "parse_bytes",
    "parse_flag_bytes",
    "size",
]

#: the word for an amount read from the machine: memory_budget= (free device memory),
#: max_host_bytes= (the rank's share of the node's host memory)
AUTO = "auto"

#: the smallest number taken as bytes without a unit (0 aside)
MIN_BARE_BYTES = 2**20

#: what each unit is, in bytes (lower case)
UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
UNITS.update({letter: UNITS[f"{letter}ib"] for letter in "kmgt"})  # Slurm's 20G: GiB
UNITS.update({f"{letter}i": UNITS[f"{letter}ib"] for letter in "kmgt"})  # free -h's 20Gi
_AMOUNT = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([kmgt]i?b?|b)?")
#: what an amount may be, for messages
FORMS = "a number of bytes (an int >= 1 MiB, or 0), or a string such as '20GiB' or '512MiB'"


def integer(value: object) -> int | None:
    """``value`` as an int when it is an integer of any integer type (an int, a NumPy
    integer), not a bool; None otherwise.  The one test of "an int" for every count the
    API takes.

    Example:
        >>> import numpy as np
        >>> integer(np.int64(3)), integer(True), integer(3.0)
        (3, None, None)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def size(nbytes: float) -> str:
    """Bytes as a person reads them: ``"1.50 MiB"``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _from_text(text: str, name: str, api: str, forms: str) -> int | None:
    """A size string as bytes, or None when it is not one."""
    match = _AMOUNT.fullmatch(text.strip().lower())
    if match is None:
        return None
    number, unit = match[1], match[2]
    if unit is None:  # a bare number in a string: bytes, as a bare number is
        bare = float(number)
        return parse_bytes(int(bare) if bare == int(bare) else bare, name, api, forms=forms)
    value = float(number) * UNITS[unit]
    if unit == "b" and value != int(value):
        raise ValueError(f"{api}: {name}={text!r} is a fractional number of bytes.")
    return int(value)


def parse_bytes(value: object, name: str, api: str, *, forms: str = FORMS) -> int:
    """``value``, an amount of memory, as a number of bytes.

    Args:
        value: an int (or NumPy integer, or whole float) of bytes, 0 or at least
            :data:`MIN_BARE_BYTES`; or a size string (see the module).
        name: the keyword the user passed (``"memory_budget"``), for messages.
        api: the function the user called, for messages.
        forms: what ``name`` accepts, for messages (a caller that also takes
            ``"auto"`` says so).

    Raises:
        TypeError: neither a number nor a string.
        ValueError: a string that is not a size; a negative, infinite or fractional
            number; a number under 1 MiB (its message suggests the string form).

    Example:
        >>> parse_bytes("1.5GiB", "memory_budget", "f"), parse_bytes(2**20, "memory_budget", "f")
        (1610612736, 1048576)
    """
    if isinstance(value, str):
        parsed = _from_text(value, name, api, forms)
        if parsed is None:
            raise ValueError(f"{api}: {name}={value!r} is not a size; give {forms}.")
        return parsed
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: {name} must be {forms}; got {type(value).__name__} {value!r}.")
    number: float = int(value) if isinstance(value, numbers.Integral) else float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{api}: {name} must be >= 0 bytes; give {forms}; got {number!r}.")
    whole = number == int(number)
    if 0 < number < MIN_BARE_BYTES:
        as_bytes = f" (or '{int(number)}B' if you mean bytes)" if whole else ""
        raise ValueError(
            f"{api}: {name}={number!r} would be {number:g} bytes: a number is a count of "
            f"bytes, and one under 1 MiB is refused as a likely slip of the unit. Write "
            f"{name}='{number:g}GiB' for {number:g} GiB{as_bytes}."
        )
    if not whole:
        raise ValueError(f"{api}: {name}={number!r} is not a whole number of bytes; give {forms}.")
    return int(number)


def parse_flag_bytes(text: str, flag: str) -> int:
    """A command-line flag's amount of memory as bytes: a bare number is GiB (``20``,
    ``0.5``), a string with a unit is what it says (``512MiB``).

    Raises:
        ValueError: not an amount, or a negative one.
    """
    stripped = text.strip()
    try:
        gib = float(stripped)
    except ValueError:
        match = _AMOUNT.fullmatch(stripped.lower())
        if match is None or match[2] is None:
            raise ValueError(
                f"{flag} {text}: expected GiB (a number, such as 20 or 0.5) or a size with "
                "its unit, such as 512MiB or 20GB"
            ) from None
        return _from_text(stripped, flag, flag, "") or 0
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"{flag} {text}: expected GiB >= 0, such as 20 or 0.5")
    return int(gib * 2**30)
