"""Device profiles: the compute rate and host link the schedule model runs at.

The built-in profiles are nominal figures, not measurements: peak dense 16-bit tensor
throughput times an achieved fraction (:data:`ACHIEVED_FRACTION`), and a typical
pinned-copy bandwidth of the host link in each direction.  ``measured`` profiles come
from the JSON of ``python -m cpu_offload.check`` or ``python -m cpu_offload.bench`` on
the machine itself, and should be preferred.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["ACHIEVED_FRACTION", "PROFILES", "DeviceProfile", "get_profile"]

#: the fraction of peak tensor throughput a transformer layer is assumed to reach
ACHIEVED_FRACTION = 0.5


@dataclass(frozen=True)
class DeviceProfile:
    """What the schedule model needs of a device.

    Attributes:
        link_bytes_per_s: device-to-host copy bandwidth (pinned memory).
        flops_per_s: the FLOP rate layers run at (achieved, not peak).
        h2d_bytes_per_s: host-to-device bandwidth; ``link_bytes_per_s`` if None.
        name: a label for tables.
        source: where the figures come from ("nominal ..." or the measured file).
    """

    link_bytes_per_s: float
    flops_per_s: float
    h2d_bytes_per_s: float | None = None
    name: str = "custom"
    source: str = "given"

    def __post_init__(self) -> None:
        for field_name in ("link_bytes_per_s", "flops_per_s", "h2d_bytes_per_s"):
            value = getattr(self, field_name)
            if value is None and field_name == "h2d_bytes_per_s":
                continue  # the link's figure, both ways
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"DeviceProfile: {field_name} must be a number of "
                    f"{'FLOP' if field_name == 'flops_per_s' else 'bytes'} per second, got "
                    f"{type(value).__name__} {value!r}."
                )
            if not 0 < value < math.inf:  # NaN fails too
                raise ValueError(
                    f"DeviceProfile: {field_name} must be a finite number > 0, got {value!r}."
                )

    @property
    def d2h(self) -> float:
        return self.link_bytes_per_s

    @property
    def h2d(self) -> float:
        return self.h2d_bytes_per_s or self.link_bytes_per_s

    @classmethod
    def from_json(cls, path: str | Path, flops_per_s: float | None = None) -> DeviceProfile:
        """A measured profile from ``python -m cpu_offload.check --json`` or the
        benchmark's ``--json``: the link as measured there; the FLOP rate given, or the
        built-in profile's whose name appears in the recorded device name."""
        document = json.loads(Path(path).read_text())

        def mapping(value: object, what: str) -> dict:
            if not isinstance(value, dict):
                raise ValueError(
                    f"DeviceProfile.from_json: {path}: expected {what} to be a JSON object, got "
                    f"{type(value).__name__}; pass the --json file of `python -m "
                    "cpu_offload.check` or of the benchmark."
                )
            return value

        document = mapping(document, "the file")
        environment = mapping(document.get("environment", {}), "'environment'")
        d2h = h2d = None
        if "ceiling_bytes_per_s" in document:  # the benchmark
            ceiling = mapping(document["ceiling_bytes_per_s"], "'ceiling_bytes_per_s'")
            d2h, h2d = ceiling.get("d2h"), ceiling.get("h2d")
        checks = document.get("checks", [])
        if not isinstance(checks, list):
            raise ValueError(f"DeviceProfile.from_json: {path}: expected 'checks' to be a list.")
        for row in checks:  # the check command
            figures = mapping(mapping(row, "each of 'checks'").get("figures", {}), "'figures'")
            d2h = figures.get("d2h_bytes_per_s", d2h)
            h2d = figures.get("h2d_bytes_per_s", h2d)
        if not d2h or not h2d:
            raise ValueError(
                f"DeviceProfile.from_json: {path} holds no measured link bandwidth (the "
                "check's 'copy bandwidth' row or the benchmark's ceiling); run "
                "`python -m cpu_offload.check --json PATH` on the device."
            )
        device_name = str(environment.get("device_name", ""))
        if flops_per_s is None:
            known = [p for key, p in PROFILES.items() if key.upper() in device_name.upper()]
            if not known:
                raise ValueError(
                    f"DeviceProfile.from_json: the device {device_name!r} matches no built-in "
                    f"profile ({', '.join(PROFILES)}); give its FLOP rate (flops_per_s=..., "
                    "or --flops on the command line)."
                )
            flops_per_s = known[0].flops_per_s
        return cls(
            link_bytes_per_s=d2h,
            flops_per_s=flops_per_s,
            h2d_bytes_per_s=h2d,
            name=f"measured ({device_name or 'unknown device'})",
            source=str(path),
        )


def _nominal(name: str, peak_flops: float, d2h: float, h2d: float, link: str) -> DeviceProfile:
    return DeviceProfile(
        link_bytes_per_s=d2h,
        flops_per_s=peak_flops * ACHIEVED_FRACTION,
        h2d_bytes_per_s=h2d,
        name=name,
        source=f"nominal: {peak_flops / 1e12:.0f} TFLOP/s peak x {ACHIEVED_FRACTION}, {link}",
    )


#: built-in profiles, nominal figures (see the module's docstring)
PROFILES: dict[str, DeviceProfile] = {
    "h100": _nominal("H100 SXM", 989e12, 52e9, 52e9, "PCIe Gen5 x16, ~52 GB/s pinned"),
    "h200": _nominal("H200 SXM", 989e12, 52e9, 52e9, "PCIe Gen5 x16, ~52 GB/s pinned"),
    "a100": _nominal("A100 SXM", 312e12, 25e9, 25e9, "PCIe Gen4 x16, ~25 GB/s pinned"),
    "gh200": _nominal("GH200", 989e12, 375e9, 375e9, "NVLink-C2C, ~375 GB/s per direction"),
    "910b": _nominal("Ascend 910B", 320e12, 45e9, 45e9, "PCIe Gen5 x16, ~45 GB/s pinned"),
}


def get_profile(device: str | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name (``"h100"``, ...), a JSON path, or the profile itself."""
    if isinstance(device, DeviceProfile):
        return device
    key = device.lower()
    if key in PROFILES:
        return PROFILES[key]
    if key.endswith(".json"):
        return DeviceProfile.from_json(device)
    raise ValueError(
        f"unknown device profile {device!r}: use one of {', '.join(PROFILES)}, a JSON file "
        "from `python -m cpu_offload.check --json`, or DeviceProfile(link_bytes_per_s=..., "
        "flops_per_s=...)."
    )


def with_flops(profile: DeviceProfile, flops_per_s: float | None) -> DeviceProfile:
    """``profile`` with its FLOP rate replaced, when one is given."""
    return profile if flops_per_s is None else replace(profile, flops_per_s=flops_per_s)
