"""Device profiles: the figures of a device that the planner and the modeled runtime share.

A profile holds what a step's time on a device follows from: the rate matrix work runs at,
the device memory's bandwidth (elementwise work is bound by it), the per-kernel launch
latency, the host time to issue one operator, and the host link in each direction, pinned
and pageable.  The planner's event model (``plan/``) and the modeled accelerator of
``cpu_offload.testing.timed_runtime`` read the same profile, so that the two derivations of
a step start from one set of numbers.

The built-in profiles are nominal figures, not measurements: peak dense 16-bit tensor
throughput times an achieved fraction (:data:`ACHIEVED_FRACTION`), the memory bandwidth of
the data sheet times :data:`ACHIEVED_MEMORY_FRACTION`, a typical pinned-copy bandwidth of
the host link in each direction, and launch and issue times typical of eager PyTorch on
that runtime.  ``measured`` profiles take the link from the JSON of
``python -m cpu_offload.check`` or ``python -m cpu_offload.bench`` on the machine itself,
and should be preferred.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "ACHIEVED_FRACTION",
    "ACHIEVED_MEMORY_FRACTION",
    "PROFILES",
    "DeviceProfile",
    "get_profile",
    "with_flops",
]

#: the fraction of peak tensor throughput a transformer layer's matrix work is assumed to reach
ACHIEVED_FRACTION = 0.5
#: the fraction of the data sheet's memory bandwidth elementwise kernels are assumed to reach
ACHIEVED_MEMORY_FRACTION = 0.8

_RATES = ("link_bytes_per_s", "flops_per_s", "h2d_bytes_per_s")
_OPTIONAL_RATES = ("h2d_bytes_per_s", "memory_bytes_per_s", "pageable_bytes_per_s")
_TIMES = ("launch_s", "host_issue_s")


@dataclass(frozen=True)
class DeviceProfile:
    """What the schedule model and the modeled runtime need of a device.

    Attributes:
        link_bytes_per_s: device-to-host copy bandwidth (pinned memory).
        flops_per_s: the FLOP rate layers run at (achieved, not peak).
        h2d_bytes_per_s: host-to-device bandwidth; ``link_bytes_per_s`` if None.
        name: a label for tables.
        source: where the figures come from ("nominal ..." or the measured file).
        memory_bytes_per_s: device memory bandwidth (achieved); a kernel takes at least
            its bytes read and written over it.  None: kernels are timed by their FLOPs
            alone.
        launch_s: device time each kernel and copy costs on top of its work.
        host_issue_s: host time to issue one kernel or copy (eager PyTorch's dispatch
            and the launch call); the modeled runtime's host clock advances by it.
        pageable_bytes_per_s: copy bandwidth to and from pageable host memory (staged
            through a pinned buffer, and synchronous for the host); half the pinned
            rate if None.
        runtime: the runtime module the device has, ``"cuda"`` or ``"npu"`` (how the
            modeled runtime behaves).
    """

    link_bytes_per_s: float
    flops_per_s: float
    h2d_bytes_per_s: float | None = None
    name: str = "custom"
    source: str = "given"
    memory_bytes_per_s: float | None = None
    launch_s: float = 0.0
    host_issue_s: float = 0.0
    pageable_bytes_per_s: float | None = None
    runtime: str = "cuda"

    def __post_init__(self) -> None:
        for field_name in _RATES + _OPTIONAL_RATES:
            value = getattr(self, field_name)
            if value is None and field_name in _OPTIONAL_RATES:
                continue  # derived (see the attributes)
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
        for field_name in _TIMES:
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"DeviceProfile: {field_name} must be a number of seconds, got "
                    f"{type(value).__name__} {value!r}."
                )
            if not 0 <= value < math.inf:
                raise ValueError(
                    f"DeviceProfile: {field_name} must be a finite number >= 0, got {value!r}."
                )
        if self.runtime not in ("cuda", "npu"):
            raise ValueError(
                f"DeviceProfile: runtime must be 'cuda' or 'npu', got {self.runtime!r}."
            )

    @property
    def d2h(self) -> float:
        return self.link_bytes_per_s

    @property
    def h2d(self) -> float:
        return self.h2d_bytes_per_s or self.link_bytes_per_s

    @property
    def pageable(self) -> float:
        """Bandwidth of a copy to or from pageable host memory."""
        return self.pageable_bytes_per_s or min(self.d2h, self.h2d) / 2

    def kernel_seconds(self, flops: float, nbytes: float) -> float:
        """Device time of one kernel: the roofline (its FLOPs at :attr:`flops_per_s` or
        its bytes at :attr:`memory_bytes_per_s`, whichever takes longer) plus the launch
        latency."""
        seconds = flops / self.flops_per_s
        if self.memory_bytes_per_s is not None:
            seconds = max(seconds, nbytes / self.memory_bytes_per_s)
        return seconds + self.launch_s

    def compute_seconds(self, flops: float, kernels: Sequence[tuple[int, int]] = ()) -> float:
        """Time of a layer's forward or backward: the sum of :meth:`kernel_seconds` over
        its ``(flops, bytes)`` kernels, or the host's time to issue them where that is
        longer (a launch-bound layer); ``flops`` at :attr:`flops_per_s` where the kernels
        are not known, or where the profile has no memory bandwidth, launch latency nor
        issue time (the same figure)."""
        if not kernels or (
            self.memory_bytes_per_s is None and self.launch_s == 0 and self.host_issue_s == 0
        ):
            return flops / self.flops_per_s
        device = sum(self.kernel_seconds(f, b) for f, b in kernels)
        return max(device, len(kernels) * self.host_issue_s)

    @classmethod
    def from_json(cls, path: str | Path, flops_per_s: float | None = None) -> DeviceProfile:
        """A measured profile from ``python -m cpu_offload.check --json`` or the
        benchmark's ``--json``: the link as measured there; the FLOP rate given, or the
        built-in profile's whose name appears in the recorded device name (with that
        profile's memory bandwidth, launch and issue times)."""
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
        known = [p for key, p in PROFILES.items() if key.upper() in device_name.upper()]
        if flops_per_s is None:
            if not known:
                raise ValueError(
                    f"DeviceProfile.from_json: the device {device_name!r} matches no built-in "
                    f"profile ({', '.join(PROFILES)}); give its FLOP rate (flops_per_s=..., "
                    "or --flops on the command line)."
                )
            flops_per_s = known[0].flops_per_s
        like = known[0] if known else cls(link_bytes_per_s=1.0, flops_per_s=1.0)
        return replace(
            like,
            link_bytes_per_s=d2h,
            flops_per_s=flops_per_s,
            h2d_bytes_per_s=h2d,
            pageable_bytes_per_s=None,
            name=f"measured ({device_name or 'unknown device'})",
            source=str(path),
        )


def _nominal(
    name: str,
    peak_flops: float,
    memory: float,
    link: tuple[float, float, str],
    runtime: str = "cuda",
) -> DeviceProfile:
    d2h, h2d, what = link
    # Eager PyTorch: ~3 us between kernels on the device, ~8 us of host time per operator
    # through the dispatcher and the launch (torch_npu's launch path costs about twice that).
    launch, issue = (3e-6, 8e-6) if runtime == "cuda" else (5e-6, 16e-6)
    return DeviceProfile(
        link_bytes_per_s=d2h,
        flops_per_s=peak_flops * ACHIEVED_FRACTION,
        h2d_bytes_per_s=h2d,
        name=name,
        source=(
            f"nominal: {peak_flops / 1e12:.0f} TFLOP/s peak x {ACHIEVED_FRACTION}, "
            f"{memory / 1e12:.2f} TB/s memory x {ACHIEVED_MEMORY_FRACTION}, {what}"
        ),
        memory_bytes_per_s=memory * ACHIEVED_MEMORY_FRACTION,
        launch_s=launch,
        host_issue_s=issue,
        runtime=runtime,
    )


_PCIE5 = (52e9, 52e9, "PCIe Gen5 x16, ~52 GB/s pinned")

#: built-in profiles, nominal figures (see the module's docstring)
PROFILES: dict[str, DeviceProfile] = {
    "h100": _nominal("H100 SXM", 989e12, 3.35e12, _PCIE5),
    "h200": _nominal("H200 SXM", 989e12, 4.8e12, _PCIE5),
    "a100": _nominal("A100 SXM", 312e12, 2.04e12, (25e9, 25e9, "PCIe Gen4 x16, ~25 GB/s pinned")),
    "gh200": _nominal(
        "GH200", 989e12, 4.0e12, (375e9, 375e9, "NVLink-C2C, ~375 GB/s per direction")
    ),
    "910b": _nominal(
        "Ascend 910B", 320e12, 1.6e12, (45e9, 45e9, "PCIe Gen5 x16, ~45 GB/s pinned"), "npu"
    ),
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
