"""Plan before you run: what offloading k layers saves and costs, from a model's shapes.

- :func:`measure_layer` (``census.py``): one layer's saved bytes, offloaded bytes and
  FLOPs, measured on the meta device with the offloader's own rules.
- :class:`DeviceProfile` (``profiles.py``): a device's compute rate and host link.
- :func:`plan_offload` (``schedule_model.py``): an event model of the default schedule
  that predicts, for every k, activation memory and exposed copy time.
- ``python -m cpu_offload.plan``: the same from the command line.
"""

from __future__ import annotations

from .census import ATTENTIONS, LayerProfile, measure_layer
from .profiles import PROFILES, DeviceProfile
from .schedule_model import Plan, PlanRow, plan_offload, simulate

__all__ = [
    "ATTENTIONS",
    "PROFILES",
    "DeviceProfile",
    "LayerProfile",
    "Plan",
    "PlanRow",
    "measure_layer",
    "plan_offload",
    "simulate",
]
