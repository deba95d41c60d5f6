"""Host libraries in tests: skipped where not installed, required where CI says so."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

#: set by .ci/run: a missing host library fails its tests instead of skipping them
REQUIRED = os.environ.get("CPU_OFFLOAD_REQUIRE_HOSTS") == "1"


def require(module: str) -> ModuleType:
    """Import ``module``, or skip the test (fail under ``CPU_OFFLOAD_REQUIRE_HOSTS=1``)."""
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed")
