"""The main job: train a small GPT with and without offload and report what changed.

Run ``python -m cpu_offload --help`` for the flags.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from .cli import Parser, at_least, device, int_list
from .context import get_cpu_offload_context
from .device.backend import DeviceBackend
from .device.runtime import get_backend
from .engine.layer_context import OffloadContext
from .hooks.selection import DEFAULT_MIN_OFFLOAD_NUMEL
from .models import DTYPES
from .models.gpt import GPT, Block, GPTConfig
from .plan import DeviceProfile, measure_layer, plan_offload

__all__ = ["RunResult", "main", "run"]


@dataclass
class RunResult:
    """What one configuration measured."""

    offloaded_layers: int | None  # None: no offload
    bytes_offloaded_per_step: int
    peak_memory: int | None
    end_of_forward_memory: int | None
    median_step_s: float
    gradients: list[list[torch.Tensor]]


def run(
    model: GPT,
    batches: list[torch.Tensor],
    backend: DeviceBackend,
    offloaded_layers: int | None,
    min_offload_numel: int,
) -> RunResult:
    """Train a copy of ``model`` on ``batches`` (SGD); record gradients of every step."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    kwargs = {}
    synchronizer = None
    if offloaded_layers is not None:
        with warnings.catch_warnings():
            # k = layers - 1 is shown on purpose, to see where overlap ends.
            warnings.filterwarnings("ignore", "cpu_offload: num_layers == model_layers - 1")
            context, sync_fn = get_cpu_offload_context(
                True,
                offloaded_layers,
                model.config.layers,
                device=backend.device,
                min_offload_numel=min_offload_numel,
            )
        kwargs = {"context": context, "sync_fn": sync_fn}
        synchronizer = cast(OffloadContext, context).offload_synchronizer  # enabled=True
    gradients, times = [], []
    peak = end_of_forward = None
    for tokens in batches:
        backend.synchronize()
        backend.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(tokens, **kwargs)
        end_of_forward = backend.memory_allocated()
        loss.backward()
        gradients.append(
            [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        )
        optimizer.step()
        backend.synchronize()
        times.append(time.perf_counter() - start)
        peak = backend.max_memory_allocated()
    moved = synchronizer.stats.bytes_offloaded // len(batches) if synchronizer else 0
    return RunResult(
        offloaded_layers,
        moved,
        peak,
        end_of_forward,
        statistics.median(times[1:] or times),
        gradients,
    )


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _parser() -> Parser:
    parser = Parser(
        prog="python -m cpu_offload",
        description="Train a small GPT with and without activation offload and compare. "
        "Prints a line per configuration as it runs, then a table: MiB offloaded per step, "
        "memory, median step time and whether gradients are bit-identical (about 10 s on "
        "2 CPU cores).",
    )
    parser.add_argument("--device", type=device, default=None, help="cpu, cuda, npu, xpu")
    parser.add_argument("--layers", type=at_least(2), default=4)
    parser.add_argument("--hidden", type=at_least(1), default=256)
    parser.add_argument("--heads", type=at_least(1), default=4)
    parser.add_argument("--seq", type=at_least(1), default=128)
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--vocab", type=at_least(1), default=1024)
    parser.add_argument("--steps", type=at_least(1), default=4)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument(
        "--offload",
        type=int_list(1),
        default=None,
        help="comma-separated numbers of offloaded layers k (default: 1, layers/2, layers-1)",
    )
    parser.add_argument("--min-offload-numel", type=at_least(0), default=DEFAULT_MIN_OFFLOAD_NUMEL)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden}: expected a multiple of --heads {args.heads}")
    ks = sorted({1, args.layers // 2, args.layers - 1}) if args.offload is None else args.offload
    if max(ks) > args.layers - 1:
        parser.error(
            f"--offload {','.join(map(str, ks))}: expected values in 1..{args.layers - 1} "
            f"(--layers {args.layers}; the last layer is never offloaded)"
        )
    backend = get_backend(args.device)
    torch.manual_seed(args.seed)
    config = GPTConfig(args.vocab, args.hidden, args.heads, args.layers, args.seq + 1)
    model = GPT(config).to(device=backend.device, dtype=DTYPES[args.dtype])
    generator = torch.Generator().manual_seed(args.seed)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(
            backend.device
        )
        for _ in range(args.steps)
    ]
    print(
        f"cpu_offload demo: device={backend.device} torch={torch.__version__} "
        f"layers={args.layers} hidden={args.hidden} seq={args.seq} batch={args.batch} "
        f"dtype={args.dtype} steps={args.steps}"
    )
    results = []
    for k in [None, *ks]:
        label = "without offload" if k is None else f"offloading k={k} of {args.layers} layers"
        print(f"  training {args.steps} steps {label} ...", end="", flush=True)
        start = time.perf_counter()
        results.append(run(model, batches, backend, k, args.min_offload_numel))
        print(f" {time.perf_counter() - start:.1f} s", flush=True)
    baseline = results[0]
    measured = backend.memory_allocated() is not None
    planned = {} if measured else _planned_end_of_forward(args, ks)
    memory = "peak MiB  end-of-fwd MiB" if measured else "block activations at end of fwd MiB"
    header = (
        f"{'device':<8} {'k':>3} {'MiB offloaded/step':>19} {memory:>36} "
        f"{'median step ms':>15} {'grads bit-identical':>20}"
    )
    print(header)
    print("-" * len(header))
    all_match = True
    for result in results:
        match = all(
            torch.equal(a, b)
            for step_a, step_b in zip(baseline.gradients, result.gradients)
            for a, b in zip(step_a, step_b)
        )
        all_match &= match
        k = "-" if result.offloaded_layers is None else str(result.offloaded_layers)
        if measured:
            memory = f"{_mib(result.peak_memory):>9} {_mib(result.end_of_forward_memory):>15}"
        else:
            memory = f"{planned[result.offloaded_layers or 0] / 2**20:.2f} (planned)"
        print(
            f"{backend.device.type:<8} {k:>3} {result.bytes_offloaded_per_step / 2**20:>19.2f} "
            f"{memory:>36} {result.median_step_s * 1e3:>15.1f} {'yes' if match else 'NO':>20}"
        )
    if not measured:
        print(
            f"The {backend.device.type} device reports no memory: the activations above are "
            "planned by `python -m cpu_offload.plan`; on a GPU this table shows the measured "
            "peak and end-of-forward memory, and the step time includes the copies' real overlap."
        )
        print(
            "Step times on a CPU are noisy and not the point here (the copies are plain "
            "memcpy, and runs swap order from one run to the next); the bytes moved and "
            "the bit-identical gradients are."
        )
    return 0 if all_match else 1


def _planned_end_of_forward(args: argparse.Namespace, ks: list[int]) -> dict[int, int]:
    """Saved activations of the blocks at the end of forward, from the planner, per k."""
    dtype = DTYPES[args.dtype]
    profile = measure_layer(
        lambda: Block(args.hidden, args.heads).to(dtype),
        torch.empty(args.batch, args.seq, args.hidden, device="meta", dtype=dtype),
        min_offload_numel=args.min_offload_numel,
        attention="cpu",
    )
    # Memory does not depend on the device's speeds; any profile gives the same bytes.
    plan = plan_offload(profile, args.layers, DeviceProfile(link_bytes_per_s=1, flops_per_s=1))
    return {row.k: row.end_of_forward_bytes for row in plan.rows}
