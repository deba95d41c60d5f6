"""``python -m cpu_offload``: the demo of :mod:`cpu_offload.demo`."""

from __future__ import annotations

import sys

from .demo import main

sys.exit(main())
