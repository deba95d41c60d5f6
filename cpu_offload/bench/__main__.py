"""Entry point of ``python -m cpu_offload.bench``."""

from __future__ import annotations

import sys

from .main import main

sys.exit(main())
