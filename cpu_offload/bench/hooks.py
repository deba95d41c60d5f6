"""``--preset hooks``: the host time our saved-tensor hooks cost per tensor.

A stack of small layers (four Linear, GELU, LayerNorm blocks each) whose compute is short, so that
the time of the pack and unpack hooks shows.  Four modes run interleaved, one
step each per round, in one process: no hooks, our hooks with nothing moved, our
hooks moving every tensor they can (``k = L - 1``, ``min_offload_numel=0``),
``torch.autograd.graph.save_on_cpu``, and ``copy_hooks``: a bare pair of hooks that
copies every tensor out and back (what save_on_cpu does on an accelerator; on the
CPU save_on_cpu copies nothing).  The cost per tensor is the median step time
minus the no-hook step time, divided by the tensors the mode handled.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from ..context import get_cpu_offload_context
from ..device.backend import DeviceBackend
from ..engine.layer_context import OffloadContext
from .counting import Collector, ModeCount
from .modes import save_on_cpu

__all__ = ["HookCost", "count_hook_costs", "measure_hook_costs", "print_counts", "print_hook_costs"]

# Nothing is large enough to move.
_NEVER = 2**62


@dataclass
class HookCost:
    """One mode of the hooks preset (milliseconds, microseconds)."""

    mode: str
    step_ms: list[float] = field(default_factory=list)
    median_step_ms: float = 0.0
    tensors_per_step: int = 0  # tensors the figure is divided by
    us_per_tensor: float | None = None
    ratio_to_save_on_cpu: float | None = None
    ratio_to_copy_hooks: float | None = None


def _stack(layers: int, width: int, device: torch.device) -> nn.ModuleList:
    """``layers`` layers of four (Linear, GELU, LayerNorm) blocks: 32 saved tensors each."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(
            *[
                module
                for _ in range(4)
                for module in (nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
            ]
        )
        for _ in range(layers)
    ]
    return nn.ModuleList(blocks).to(device)


def _count_saved(stack: nn.ModuleList, x: torch.Tensor) -> list[int]:
    """Tensors autograd saves per layer."""
    counts = []
    for layer in stack:
        seen = [0]

        def pack(tensor: torch.Tensor, seen: list[int] = seen) -> torch.Tensor:
            seen[0] += 1
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = layer(x)
        counts.append(seen[0])
    return counts


def _runner(mode: str, stack: nn.ModuleList, backend: DeviceBackend) -> tuple[Callable, Any]:
    layers = len(stack)
    if mode == "none":
        return (lambda x: _plain(stack, x)), None
    if mode == "empty_hooks":  # the floor: a hook pair that does nothing

        def run_empty(x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                return _plain(stack, x)

        return run_empty, None
    if mode == "copy_hooks":
        device, pin = backend.device, backend.pin_memory

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            return host.copy_(tensor, non_blocking=pin)

        def unpack(host: torch.Tensor) -> torch.Tensor:
            target = torch.empty(host.shape, dtype=host.dtype, device=device)
            return target.copy_(host, non_blocking=pin)

        def run_copying(x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return _plain(stack, x)

        return run_copying, None
    if mode == "save_on_cpu":

        def run(x: torch.Tensor) -> torch.Tensor:
            with save_on_cpu(backend):
                return _plain(stack, x)

        return run, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k = L - 1 on purpose
        ctx, sync_fn = get_cpu_offload_context(
            True,
            layers - 1,
            layers,
            device=backend.device,
            min_offload_numel=0 if mode == "hooks:move" else _NEVER,
        )

    def offloaded(x: torch.Tensor) -> torch.Tensor:
        for layer in stack:
            with ctx:
                x = layer(x)
            x = sync_fn(x)
        return x

    synchronizer = cast(OffloadContext, ctx).offload_synchronizer
    if mode != "hooks:move":
        synchronizer.warn_if_nothing_moved = False  # nothing moves on purpose here
    return offloaded, synchronizer


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def count_hook_costs(
    backend: DeviceBackend,
    collector: Collector,
    layers: int = 16,
    width: int = 64,
    batch: int = 32,
    steps: int = 5,
    warmup: int = 2,
) -> list[ModeCount]:
    """Each mode in turn: ``warmup`` steps, then ``steps`` steps between the collector's
    start and stop; :mod:`cpu_offload.bench.counting` says what is counted."""
    stack = _stack(layers, width, backend.device)
    x = torch.randn(batch, width, device=backend.device, requires_grad=True)
    saved = _count_saved(stack, x)
    results = []
    for mode in COUNTED_MODES:
        run, synchronizer = _runner(mode, stack, backend)
        elapsed, moved = _count_steps(run, synchronizer, x, collector, steps, warmup)
        if mode == "hooks:move":
            tensors = moved
        elif mode == "hooks:stay":
            tensors = sum(saved[:-1])  # our hooks cover layers 0..L-2
        else:
            tensors = 0 if mode == "none" else sum(saved)
        results.append(ModeCount(mode, steps, tensors, elapsed / steps))
    # The fixed cost of a layer: the same stack of layers that save nothing.
    empty = nn.ModuleList([_SavesNothing() for _ in range(layers)])
    for mode, runner in (("layers:none", "none"), ("layers:hooks", "hooks:stay")):
        run, synchronizer = _runner(runner, empty, backend)
        elapsed, _ = _count_steps(run, synchronizer, x, collector, steps, warmup)
        results.append(ModeCount(mode, steps, 0, elapsed / steps, layers=layers))
    return results


class _SavesNothing(nn.Module):
    """A layer whose forward saves no tensor for backward (``x + 1``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _count_steps(
    run: Callable, synchronizer: Any, x: torch.Tensor, collector: Collector, steps: int, warmup: int
) -> tuple[float, int]:
    """What ``steps`` steps cost after ``warmup`` ones, and the tensors moved per step."""
    for _ in range(warmup):
        run(x).sum().backward()
    moved = synchronizer.stats.tensors_offloaded if synchronizer else 0
    collector.start()
    for _ in range(steps):
        run(x).sum().backward()
    elapsed = collector.stop()
    moved = (synchronizer.stats.tensors_offloaded - moved) // steps if synchronizer else 0
    return elapsed, moved


#: the modes ``--count`` measures per tensor, in order; ``empty_hooks`` is the floor.
#: Then ``layers:none`` and ``layers:hooks``: the same layers saving nothing, for the
#: fixed cost of a layer under our context and ``sync_fn``.
COUNTED_MODES = ["none", "empty_hooks", "hooks:stay", "hooks:move", "save_on_cpu", "copy_hooks"]


def print_counts(modes: list[ModeCount], unit: str) -> None:
    """Cost per saved tensor above no hooks, and its ratio to the floors."""
    per = {m.mode: m for m in modes}
    base = per["none"].per_step
    fixed = [per.pop(name, None) for name in ("layers:none", "layers:hooks")]
    modes = list(per.values())

    def per_tensor(mode: str) -> float | None:
        m = per[mode]
        return (m.per_step - base) / m.tensors_per_step if m.tensors_per_step else None

    header = (
        f"{'mode':<12} {unit + '/step':>18} {'tensors/step':>13} {unit + '/tensor':>18} "
        f"{'vs empty pair':>14} {'vs copy_hooks':>14} {'vs save_on_cpu':>15}"
    )
    print(header)
    print("-" * len(header))
    floors = {name: per_tensor(name) for name in ("empty_hooks", "copy_hooks", "save_on_cpu")}
    for m in modes:
        cost = per_tensor(m.mode)
        ratios = [
            "-" if cost is None or not floor else f"{cost / floor:.2f}x"
            for floor in floors.values()
        ]
        print(
            f"{m.mode:<12} {m.per_step:>18,.0f} {m.tensors_per_step or '-'!s:>13} "
            f"{'-' if cost is None else f'{cost:,.0f}':>18} {ratios[0]:>14} {ratios[1]:>14} "
            f"{ratios[2]:>15}"
        )
    print(
        f"{unit}/tensor: (a step of the mode - a step without hooks) / the tensors the mode "
        "handled (hooks:stay: the tensors our hooks saw; hooks:move: the tensors moved). "
        "Targets (issue 21): hooks:move <= 1.5x copy_hooks, hooks:stay <= 2.0x the empty pair."
    )
    if fixed[0] is not None and fixed[1] is not None:
        per_layer = (fixed[1].per_step - fixed[0].per_step) / fixed[1].layers
        print(
            f"fixed cost per layer: {per_layer:,.0f} {unit} (layers that save nothing, with "
            "our context and sync_fn, minus without; hooks on all but the last)"
        )


def _plain(stack: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in stack:
        x = layer(x)
    return x


def measure_hook_costs(
    backend: DeviceBackend,
    layers: int = 16,
    width: int = 64,
    batch: int = 32,
    rounds: int = 30,
    warmup: int = 3,
) -> list[HookCost]:
    """Run the four modes interleaved for ``rounds`` rounds; the costs per tensor."""
    device = backend.device
    stack = _stack(layers, width, device)
    x = torch.randn(batch, width, device=device, requires_grad=True)
    saved = _count_saved(stack, x)
    modes = ["none", "hooks:stay", "hooks:move", "save_on_cpu", "copy_hooks"]
    runners = {mode: _runner(mode, stack, backend) for mode in modes}
    results = {mode: HookCost(mode) for mode in modes}
    moved_before = {
        mode: sync.stats.tensors_offloaded for mode, (_, sync) in runners.items() if sync
    }
    for round_ in range(warmup + rounds):
        for mode in modes:
            run, _ = runners[mode]
            backend.synchronize()
            start, end = backend.timing_event(), backend.timing_event()
            start.record(backend.current_stream())
            run(x).sum().backward()
            end.record(backend.current_stream())
            backend.synchronize()
            if round_ >= warmup:
                results[mode].step_ms.append(start.elapsed_time(end))
        if round_ == warmup - 1:
            moved_before = {
                mode: sync.stats.tensors_offloaded for mode, (_, sync) in runners.items() if sync
            }
    for result in results.values():
        result.median_step_ms = statistics.median(result.step_ms)
    hooked = sum(saved[:-1])  # our hooks cover layers 0..L-2
    moved = (
        runners["hooks:move"][1].stats.tensors_offloaded - moved_before["hooks:move"]
    ) // rounds
    results["hooks:stay"].tensors_per_step = hooked
    results["hooks:move"].tensors_per_step = moved
    results["save_on_cpu"].tensors_per_step = sum(saved)
    results["copy_hooks"].tensors_per_step = sum(saved)
    base = results["none"].median_step_ms
    for mode in modes[1:]:
        result = results[mode]
        if result.tensors_per_step:
            result.us_per_tensor = 1e3 * (result.median_step_ms - base) / result.tensors_per_step
    reference = results["save_on_cpu"].us_per_tensor
    floor = results["copy_hooks"].us_per_tensor
    for mode in ("hooks:stay", "hooks:move"):
        cost = results[mode].us_per_tensor
        if cost is not None and reference:
            results[mode].ratio_to_save_on_cpu = cost / reference
        if cost is not None and floor:
            results[mode].ratio_to_copy_hooks = cost / floor
    return [results[mode] for mode in modes]


def print_hook_costs(results: list[HookCost]) -> None:
    header = (
        f"{'mode':<12} {'median ms':>10} {'min-max ms':>15} {'tensors/step':>13} "
        f"{'us/tensor':>10} {'vs save_on_cpu':>15} {'vs copy_hooks':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        spread = f"{min(r.step_ms):.2f}-{max(r.step_ms):.2f}"
        cost = "-" if r.us_per_tensor is None else f"{r.us_per_tensor:.1f}"
        ratio = "-" if r.ratio_to_save_on_cpu is None else f"{r.ratio_to_save_on_cpu:.2f}x"
        floor = "-" if r.ratio_to_copy_hooks is None else f"{r.ratio_to_copy_hooks:.2f}x"
        tensors = r.tensors_per_step or "-"
        print(
            f"{r.mode:<12} {r.median_step_ms:>10.2f} {spread:>15} {tensors!s:>13} "
            f"{cost:>10} {ratio:>15} {floor:>14}"
        )
    print(
        "us/tensor: (median step - median step of none) / tensors per step; hooks:stay "
        "divides by the tensors our hooks saw, hooks:move by the tensors moved, "
        "save_on_cpu and copy_hooks by every saved tensor. copy_hooks: the least a hook "
        "pair that copies out and back does (save_on_cpu copies nothing on the CPU)."
    )
