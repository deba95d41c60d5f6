"""The package's logger, ``logging.getLogger("cpu_offload")``, and warnings that are also
log records.

The package logs what it decided (the layers found, the policy applied, the thresholds)
at ``INFO``, and each warning it gives at ``WARNING`` as well as through ``warnings``.
The logger has a ``NullHandler``: nothing is printed unless the program configures
logging (``logging.basicConfig(level=logging.INFO)``), and then the records go where its
other logs go (a Trainer's, a recipe's).
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import warnings

__all__ = ["logger", "user_stacklevel", "warn"]

logger = logging.getLogger("cpu_offload")
logger.addHandler(logging.NullHandler())

#: where library code lives: a frame under one of these is not the user's call
_LIBRARIES = tuple(
    os.path.join(os.path.realpath(path), "")
    for path in {
        os.path.dirname(__file__),  # this package's folder
        *(sysconfig.get_paths().get(key, "") for key in ("stdlib", "purelib", "platlib")),
    }
    if path
)
_PACKAGE = os.path.join(os.path.realpath(os.path.dirname(__file__)), "")


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: an interpreter's own
        return not filename.startswith(("<stdin>", "<string>", "<doctest"))
    return os.path.realpath(filename).startswith(_LIBRARIES)


def user_stacklevel(start: int = 1) -> int:
    """The ``stacklevel`` (for the function that calls this one) of the first frame outside
    libraries: this package, torch, transformers, everything installed, the standard
    library.  A warning given there points at the user's line that led to it (their
    ``loss.backward()``, their ``trainer.train()``), not at a line of transformers that
    happened to run a hook.  Where every frame is a library's (a program installed as a
    package), the first frame outside this package.

    Args:
        start: the ``stacklevel`` to start from (1: the caller of the caller of this).
    """
    frame = sys._getframe(1)  # the function that asks
    outside_package: int | None = None
    level = 1
    while frame is not None:
        if level >= start:
            name = frame.f_code.co_filename
            if not _is_library(name):
                return level
            if outside_package is None and not os.path.realpath(name).startswith(_PACKAGE):
                outside_package = level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return outside_package if outside_package is not None else start


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category)`` pointing at the user's line that led to it
    (:func:`user_stacklevel`, from the caller's ``stacklevel`` on), and the same message
    as a ``WARNING`` record."""
    level = user_stacklevel(stacklevel + 1)
    warnings.warn(message, category, stacklevel=level)
    logger.warning(message, stacklevel=level)
