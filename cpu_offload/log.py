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
import warnings

__all__ = ["logger", "warn"]

logger = logging.getLogger("cpu_offload")
logger.addHandler(logging.NullHandler())


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category)`` at the caller's ``stacklevel`` (as if the caller
    had called it), and the same message as a ``WARNING`` record."""
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    logger.warning(message, stacklevel=stacklevel + 1)
