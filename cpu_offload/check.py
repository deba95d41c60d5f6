"""``python -m cpu_offload.check``: the first command to run on a machine with a GPU or NPU.

It checks, on whatever device is there and in about a minute, what a user relies on:
bit-identical gradients for every k, end-of-forward memory against the analytic
``(L - k) * T``, the copy bandwidth against a raw pinned copy measured in the same
run, host synchronisations in a steady-state step, and Float8 and MXFP8 offload
round trips; then the same gradients through the simulated CUDA and NPU runtimes.
Each row reads PASS, FAIL or NOT RUN with the reason; the exit status is 1 when a
row FAILs.  ``--json PATH`` writes the rows and the environment.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from quantized import Float8Quantizer, MXFP8Quantizer, QuantizedLinear

from .cli import Parser, device, output_file
from .context import get_cpu_offload_context
from .device.backend import DeviceBackend
from .device.link import measure_ceiling
from .device.runtime import deterministic_algorithms, device_name, get_backend
from .models.gpt import Block
from .report.copy_timer import CopyTimer
from .testing import strict_runtime

__all__ = ["CheckResult", "main", "run_checks"]

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
LAYERS = 4
#: end-of-forward memory may differ from (L - k) * T by this fraction (small
#: saved tensors stay on the device by design)
MEMORY_TOLERANCE = 0.10
#: our copies must reach this fraction of a raw pinned copy's bandwidth
BANDWIDTH_FLOOR = 0.70


@dataclass
class CheckResult:
    """One row of the table."""

    name: str
    status: str
    detail: str
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class _Shape:
    hidden: int
    heads: int
    seq: int
    batch: int
    dtype: torch.dtype


def _shape(backend: DeviceBackend) -> _Shape:
    if backend.device.type == "cpu":
        return _Shape(hidden=64, heads=4, seq=32, batch=2, dtype=torch.float32)
    return _Shape(hidden=1024, heads=8, seq=2048, batch=4, dtype=torch.bfloat16)


def _stack(shape: _Shape, device: torch.device, make: Callable[[], nn.Module] | None = None):
    torch.manual_seed(0)
    make = make or (lambda: Block(shape.hidden, shape.heads))
    return nn.ModuleList(make() for _ in range(LAYERS)).to(device, shape.dtype)


def _input(shape: _Shape, device: torch.device, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=generator)
    return x.to(device, shape.dtype).requires_grad_()


def _context(k: int, backend: DeviceBackend, min_offload_numel: int | None = None):
    """The offload context for k layers; on the CPU the check's tensors are small, so the
    size threshold is off there."""
    options: dict[str, Any] = {"device": backend.device}
    if min_offload_numel is None and backend.device.type == "cpu":
        min_offload_numel = 0
    if min_offload_numel is not None:
        options["min_offload_numel"] = min_offload_numel
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cpu_offload: num_layers == model_layers - 1")
        return get_cpu_offload_context(True, k, LAYERS, **options)


def _forward(layers: nn.ModuleList, x: torch.Tensor, ctx: Any, sync_fn: Any) -> torch.Tensor:
    h = x
    for layer in layers:
        with ctx if ctx is not None else contextlib.nullcontext():
            h = layer(h)
        h = sync_fn(h) if sync_fn is not None else h
    return h


def _step(layers: nn.ModuleList, x: torch.Tensor, ctx: Any = None, sync_fn: Any = None):
    """One forward and backward; the gradients of the parameters and the input."""
    layers.zero_grad(set_to_none=True)
    x.grad = None
    _forward(layers, x, ctx, sync_fn).float().square().mean().backward()
    return [_grad(p) for p in layers.parameters()] + [_grad(x)]


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.grad is None:
        raise RuntimeError(f"check: no gradient reached a tensor of shape {tuple(tensor.shape)}.")
    return tensor.grad.clone()


def _differing(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> int:
    return sum(not torch.equal(a, b) for a, b in zip(expected, actual))


def check_gradients(
    backend: DeviceBackend,
    name: str,
    make: Callable[[], nn.Module] | None = None,
    ks: Sequence[int] = range(1, LAYERS),
) -> CheckResult:
    """Gradients with k offloaded layers, ``torch.equal`` to those without offload."""
    with deterministic_algorithms():
        try:
            return _compare_gradients(backend, name, make, ks)
        except RuntimeError as error:
            if "deterministic" not in str(error):
                raise
            reason = str(error).splitlines()[0]
            return CheckResult(name, NOT_RUN, f"no deterministic kernel to compare with: {reason}")


def _compare_gradients(
    backend: DeviceBackend,
    name: str,
    make: Callable[[], nn.Module] | None,
    ks: Sequence[int],
) -> CheckResult:
    shape = _shape(backend)
    layers = _stack(shape, backend.device, make)
    x = _input(shape, backend.device)
    expected = _step(layers, x)
    if _differing(expected, _step(layers, x)):
        return CheckResult(
            name,
            NOT_RUN,
            "two runs without offload already differ under deterministic algorithms "
            "(a nondeterministic kernel torch does not flag)",
        )
    failures, moved = [], 0
    for k in ks:
        ctx, sync_fn = _context(k, backend, min_offload_numel=0 if make is not None else None)
        actual = _step(layers, x, ctx, sync_fn)
        moved += ctx.offload_synchronizer.stats.tensors_offloaded
        differing = _differing(expected, actual)
        if differing:
            failures.append(f"k={k}: {differing} of {len(actual)} differ")
    ks_text = f"k = {ks[0]}..{ks[-1]}" if len(ks) > 1 else f"k = {ks[0]}"
    if failures:
        return CheckResult(name, FAIL, "; ".join(failures))
    if moved == 0:
        return CheckResult(name, FAIL, f"{ks_text}: nothing was offloaded")
    return CheckResult(
        name, PASS, f"{ks_text}: all {len(expected)} gradients torch.equal, {moved} tensors moved"
    )


def _held_after_forward(
    backend: DeviceBackend, layers: nn.ModuleList, x: torch.Tensor, ctx: Any, sync_fn: Any
) -> int:
    backend.synchronize()
    before = backend.memory_allocated() or 0
    h = _forward(layers, x, ctx, sync_fn)
    backend.synchronize()
    held = (backend.memory_allocated() or 0) - before
    h.float().square().mean().backward()
    del h
    backend.synchronize()
    return held


def check_memory(backend: DeviceBackend) -> CheckResult:
    """End-of-forward activation memory with k offloaded layers against (L - k) * T."""
    name = "end-of-forward memory = (L-k)*T"
    if backend.device.type == "cpu" or backend.memory_allocated() is None:
        return CheckResult(name, NOT_RUN, f"{backend.device} reports no device memory")
    shape = _shape(backend)
    layers = _stack(shape, backend.device)
    x = _input(shape, backend.device)
    _held_after_forward(backend, layers, x, None, None)  # gradients allocated, allocator warm
    per_layer = _held_after_forward(backend, layers, x, None, None) / LAYERS
    figures, failures = {"T_bytes": per_layer}, []
    for k in range(1, LAYERS):
        ctx, sync_fn = _context(k, backend)
        _held_after_forward(backend, layers, x, ctx, sync_fn)  # warm-up
        measured = _held_after_forward(backend, layers, x, ctx, sync_fn)
        expected = (LAYERS - k) * per_layer
        figures[f"k{k}_ratio"] = measured / expected
        if abs(measured - expected) > MEMORY_TOLERANCE * expected:
            failures.append(f"k={k}: {measured / 2**20:.1f} MiB, expected {expected / 2**20:.1f}")
    ratios = ", ".join(f"{figures[f'k{k}_ratio']:.3f}" for k in range(1, LAYERS))
    if failures:
        return CheckResult(name, FAIL, "; ".join(failures), figures)
    return CheckResult(
        name, PASS, f"T = {per_layer / 2**20:.1f} MiB; measured/expected {ratios}", figures
    )


def check_bandwidth(backend: DeviceBackend) -> CheckResult:
    """Bandwidth of the offloader's copies against a raw pinned copy, in this run."""
    name = "copy bandwidth vs raw pinned copy"
    if backend.device.type == "cpu":
        return CheckResult(name, NOT_RUN, "no host-device link on a CPU-only machine")

    shape = _shape(backend)
    layers = _stack(shape, backend.device)
    x = _input(shape, backend.device)
    ctx, sync_fn = _context(LAYERS // 2, backend)
    _step(layers, x, ctx, sync_fn)  # host buffers allocated
    timer = ctx.offload_synchronizer.copy_timer = CopyTimer(backend)
    for _ in range(3):
        _step(layers, x, ctx, sync_fn)
    backend.synchronize()
    raw = measure_ceiling(backend, 256 * 2**20)
    figures: dict[str, float] = {}
    parts, failed = [], False
    for direction in ("d2h", "h2d"):
        ours = timer.bandwidth(direction) or 0.0
        ratio = ours / raw[direction]
        figures.update(
            {f"{direction}_bytes_per_s": ours, f"raw_{direction}_bytes_per_s": raw[direction]}
        )
        parts.append(f"{direction} {ours / 1e9:.1f}/{raw[direction] / 1e9:.1f} GB/s ({ratio:.0%})")
        failed |= ratio < BANDWIDTH_FLOOR
    detail = ", ".join(parts) + f"; floor {BANDWIDTH_FLOOR:.0%}"
    return CheckResult(name, FAIL if failed else PASS, detail, figures)


def check_host_syncs(backend: DeviceBackend) -> CheckResult:
    """Host synchronisations in a steady-state step (after buffers are allocated)."""
    name = "host syncs in a steady-state step"
    shape = _shape(backend)
    layers = _stack(shape, backend.device)
    x = _input(shape, backend.device)
    ctx, sync_fn = _context(LAYERS // 2, backend)
    for _ in range(2):
        _step(layers, x, ctx, sync_fn)
    backend.synchronize()
    with backend.count_host_syncs() as syncs:
        _step(layers, x, ctx, sync_fn)
    if syncs is None:
        runtime = getattr(backend, "runtime_type", None)
        reason = (
            f"the {runtime} runtime does not report synchronisations to Python"
            if runtime is not None
            else "the host backend has no device to synchronise with"
        )
        return CheckResult(name, NOT_RUN, reason)
    if syncs[0] == 0:
        return CheckResult(name, PASS, "0 synchronising calls", {"syncs": 0})
    sites = ", ".join(getattr(backend, "sync_sites", [])) or "sites unknown"
    return CheckResult(name, FAIL, f"{syncs[0]} synchronising calls ({sites})", {"syncs": syncs[0]})


def check_quantized(backend: DeviceBackend, fmt: str) -> CheckResult:
    """Offloaded quantized activations come back bit for bit (gradients torch.equal)."""

    quantizer = {"Float8": Float8Quantizer, "MXFP8": MXFP8Quantizer}[fmt]
    hidden = _shape(backend).hidden

    def make() -> nn.Module:
        return nn.Sequential(QuantizedLinear(hidden, hidden, quantizer=quantizer()), nn.Tanh())

    return check_gradients(backend, f"{fmt} offload round trip", make, ks=[LAYERS // 2])


def check_simulated(flavour: str) -> CheckResult:
    """The accelerator backend on the simulated runtime, every hazard checked (CPU)."""

    with strict_runtime(flavour):
        result = check_gradients(get_backend("cpu"), "")
    result.name = f"simulated {flavour.upper()} runtime (strict)"
    return result


def environment(backend: DeviceBackend) -> dict[str, str]:
    info = {"torch": torch.__version__, "device": str(backend.device)}
    info["device_name"] = device_name(backend.device)
    if torch.version.cuda and backend.device.type == "cuda":
        info["cuda"] = torch.version.cuda
    try:
        info["torch_npu"] = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        info["torch_npu"] = "not installed"
    return info


def run_checks(device: str | None = None) -> tuple[dict[str, str], list[CheckResult]]:
    """The environment and one result per check, on ``device`` (the best available)."""
    backend = get_backend(device)
    checks: list[tuple[str, Callable[[], CheckResult]]] = [
        (
            "gradients",
            lambda: check_gradients(backend, f"gradients bit-identical on {backend.device.type}"),
        ),
        ("memory", lambda: check_memory(backend)),
        ("bandwidth", lambda: check_bandwidth(backend)),
        ("host syncs", lambda: check_host_syncs(backend)),
        ("Float8", lambda: check_quantized(backend, "Float8")),
        ("MXFP8", lambda: check_quantized(backend, "MXFP8")),
        ("simulated CUDA", lambda: check_simulated("cuda")),
        ("simulated NPU", lambda: check_simulated("npu")),
    ]
    results = []
    for label, check in checks:
        try:
            results.append(check())
        except Exception as error:  # noqa: BLE001 - a crash is a failed check, reported
            results.append(CheckResult(label, FAIL, f"raised {type(error).__name__}: {error}"))
    return environment(backend), results


def print_table(info: dict[str, str], results: list[CheckResult]) -> None:
    print("cpu_offload check: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    width = max(len(r.name) for r in results)
    for result in results:
        print(f"{result.status:<8} {result.name:<{width}}  {result.detail}")
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, NOT_RUN)}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if info["device"] == "cpu":
        print(
            "No accelerator here: the device rows were not run. Run this command on a "
            "machine with a GPU or an Ascend NPU to check them."
        )


@contextlib.contextmanager
def _timed() -> Iterator[None]:
    start = time.perf_counter()
    yield
    print(f"({time.perf_counter() - start:.1f} s)")


def _device_row(device: str, simulate: str | None) -> tuple[str, str]:
    """``--full``'s first row: these checks, on the device."""
    if simulate:
        return NOT_RUN, "the device checks measure the device: python -m cpu_offload.check"
    _, results = run_checks(device)
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL)}
    return (FAIL if counts[FAIL] else PASS), f"{counts[PASS]} PASS, {counts[FAIL]} FAIL"


def main(argv: Sequence[str] | None = None) -> int:
    # --help prints the docstring as text: without its reST markup
    description = (__doc__ or "").replace("``", "")
    parser = Parser(prog="python -m cpu_offload.check", description=description)
    parser.add_argument(
        "--device",
        type=device,
        help="the device to check: cpu, cuda, npu, ... (default: the best available)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=output_file,
        help="also write the rows and the environment as JSON to PATH (default: none, "
        "the table is printed only)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="run every check still owed to a GPU, most valuable first: the device checks, "
        "pytest -m gpu, the benchmarks, the peers, sliced and on-demand reloads, the "
        "pipeline, pinned memory and the host pool, compiled layers, a captured step "
        "(default: the device checks only)",
    )
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="with --full: run every check it can on this modeled device (h100, h200, ...) "
        "on the CPU (default: none, on the device)",
    )
    if importlib.util.find_spec("torch_npu") is not None:
        importlib.import_module("torch_npu")  # registers the NPU, found only once imported
    args = parser.parse_args(argv)
    if args.simulate and not args.full:
        parser.error("--simulate PROFILE: goes with --full")
    if args.full:  # NOTE [The first hour on a GPU] in check_full.py
        from .check_full import report_full, run_full

        with _timed():
            rows = run_full(args.device, args.simulate, _device_row)
        return report_full(rows, args.simulate, args.json)
    with _timed():
        info, results = run_checks(args.device)
        print_table(info, results)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"environment": info, "checks": [asdict(r) for r in results]}, file, indent=2)
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
