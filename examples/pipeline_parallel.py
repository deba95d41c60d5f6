"""Activation offload inside pipeline-parallel stages (torch.distributed.pipelining).

Run on two processes (CPU and gloo, GPUs and nccl, or Ascend NPUs and hccl):

    torchrun --standalone --nproc-per-node 2 examples/pipeline_parallel.py
    torchrun --standalone --nproc-per-node 2 examples/pipeline_parallel.py \
        --schedule interleaved --microbatches 8 --memory-budget 4.5MiB
    torchrun --standalone --nproc-per-node 4 examples/pipeline_parallel.py \
        --microbatches 8 --memory-budget 4.5MiB

At their defaults (2 layers per stage, 128 tokens of 64 features) a stage's passes in flight
save 2 to 8.5 MiB: with 4.5 MiB each stage gets a plan of its own, and the stages with
the most passes in flight move some whole (``keep 1 pass, 3 of 4 moved whole``).

Each stage offloads the activations of its first ``--offload`` layers. Several
micro-batches are in flight in each stage (1F1B), and every forward pass owns its own
layer states, so nothing a later backward needs is freed early. The script trains one
step with and one without offload and checks that every rank's gradients are
bit-identical (exit code 1 if not).

With ``--memory-budget B`` (bytes, or a size such as ``"12MiB"``) each stage is given
``offload_layers(stage.layers, memory_budget=B)`` instead: its first step runs as the
model does, measured with every micro-batch its schedule keeps in flight, and the second
runs the plan made for that stage (``keep_passes`` where moving whole passes fits
better).  Each rank prints, per stage, the passes in flight, the saved peak (the most
saved-activation bytes the offloader's own counts held on the device at once during the
planned step; a checkpointed layer holds its inputs, and its recompute while its
backward runs), the plan's predicted peak, the peak without offload and the budget; the
exit code is 1 unless the gradients are bit-identical, the saved peak is within the
budget and within 2% of the plan.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from cpu_offload import offload_layers
from cpu_offload.device.amounts import parse_bytes
from cpu_offload.device.runtime import distributed_setup
from cpu_offload.engine.pass_schedule import held_on_device
from cpu_offload.models.llama import LlamaConfig, LlamaLayer
from cpu_offload.policy.policy import CHECKPOINTED

CONFIG = LlamaConfig(hidden=64, heads=4, kv_heads=2, ffn=128, layers=0, vocab=128)


class Stage(nn.Module):
    """A contiguous slice of the decoder."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaLayer(CONFIG) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_stages(rank: int, world: int, per_rank: int, layers: int, device) -> list[Stage]:
    """All stages are built on every rank from one seed; each rank keeps its own."""
    torch.manual_seed(0)
    stages = [Stage(layers) for _ in range(world * per_rank)]
    mine = [rank + world * i for i in range(per_rank)]  # interleaved placement
    return [(index, stages[index].to(device)) for index in mine]


class SavedPeak:
    """The most saved-activation bytes a stage's offloader held on the device at once, by
    its own counts (``held_on_device``: what each layer saved in the measured step, while
    its state has it on the device), sampled after every layer's forward and before every
    layer's backward while ``active``."""

    def __init__(self, handle, layers) -> None:
        self.handle, self.peak, self.active = handle, 0, False
        for layer in layers:
            layer.register_forward_hook(lambda *_: self.sample())
            layer.register_full_backward_pre_hook(lambda *_: self.sample())

    def sample(self) -> None:
        measured, plan = self.handle.auto.measured, self.handle.plan
        if self.active and measured is not None and plan is not None:
            saved, stays, recompute = planned_bytes(measured, plan.policy)
            passes = self.handle.offload_synchronizer.in_flight_passes()
            self.peak = max(self.peak, held_on_device(passes, saved, stays, recompute))


def planned_bytes(measured, policy) -> tuple[list[int], list[int], list[int]]:
    """Per layer, from the measured step's records: what it saves in the planned step
    (a checkpointed layer: its inputs), what of that cannot move, and what its backward
    saves beside it (a checkpointed layer's recompute: the rest of the layer)."""
    rows = []
    for record, choice in zip(measured, policy, strict=True):
        if record is None:
            rows.append((0, 0, 0))
        elif choice in CHECKPOINTED:
            inputs = record.input_bytes
            stays = inputs - record.input_offloaded_bytes
            rows.append((inputs, stays, record.saved_bytes - inputs))
        else:
            rows.append((record.saved_bytes, record.kept_bytes, 0))
    saved, stays, recompute = (list(column) for column in zip(*rows, strict=True))
    return saved, stays, recompute


def run(args, rank: int, world: int, device, offload: bool):
    """The gradients of the last of ``args.steps`` steps, and per stage what was offloaded
    (its handle, and its saved peak under a memory budget)."""
    per_rank = 2 if args.schedule == "interleaved" else 1
    stages = build_stages(rank, world, per_rank, args.layers_per_stage, device)
    handles, peaks = [], []
    for _, module in stages if offload else []:
        if args.memory_budget is None:
            handle = offload_layers(module.layers, args.offload, min_offload_numel=0, device=device)
        else:
            handle = offload_layers(
                module.layers,
                memory_budget=args.memory_budget,
                min_offload_numel=0,
                device=device,
                copy_bandwidth=args.copy_bandwidth,
            )
            peaks.append(SavedPeak(handle, module.layers))
        handles.append(handle)
    pipeline_stages = [
        PipelineStage(module, index, world * per_rank, device) for index, module in stages
    ]

    def loss_fn(output, target):
        return (output - target).square().mean()

    if args.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(pipeline_stages, args.microbatches, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(pipeline_stages[0], args.microbatches, loss_fn=loss_fn)
    generator = torch.Generator().manual_seed(1)
    shape = (2 * args.microbatches, args.tokens, CONFIG.hidden)
    x = torch.randn(shape, generator=generator).to(device)
    target = torch.randn(x.shape, generator=generator).to(device)
    has_first = any(index == 0 for index, _ in stages)
    has_last = any(index == world * per_rank - 1 for index, _ in stages)
    for step in range(args.steps):
        for _, module in stages:
            module.zero_grad(set_to_none=True)
        for peak in peaks:
            peak.active = step == args.steps - 1  # the planned step
        schedule.step(*([x] if has_first else []), **({"target": target} if has_last else {}))
    for handle in handles:
        stats = handle.offload_synchronizer.stats
        if stats.tensors_offloaded == 0 and args.memory_budget is None:
            raise RuntimeError("the offloaded run moved nothing to the host")
        handle.remove()
    grads = [p.grad.detach().clone() for _, module in stages for p in module.parameters()]
    return grads, [index for index, _ in stages], handles, peaks


def budget_lines(args, rank: int, indices, handles, peaks, same: bool) -> tuple[list[str], bool]:
    """One line per stage of this rank under ``--memory-budget``, and whether every
    stage's saved peak is within the budget and within 2% of its plan."""
    budget = parse_bytes(args.memory_budget, "--memory-budget", "pipeline_parallel.py")
    lines, ok = [], True
    for index, handle, peak in zip(indices, handles, peaks):
        plan, measured = handle.plan, handle.auto.measured or []
        if plan is None:
            raise RuntimeError(f"stage {index}: no plan was made ({handle!r})")
        without = plan.in_flight * sum(r.saved_bytes for r in measured if r is not None)
        predicted = plan.predicted.peak_bytes
        close = abs(peak.peak - predicted) <= 0.02 * max(predicted, 1)
        ok = ok and peak.peak <= budget and close
        lines.append(
            f"rank {rank}: stage {index}, in flight {plan.in_flight}, saved peak "
            f"{peak.peak / 2**20:.2f} MiB (plan {predicted / 2**20:.2f} MiB), without offload "
            f"{without / 2**20:.2f} MiB, budget {budget / 2**20:.2f} MiB, policy "
            f"{plan.runs()}: gradients bit-identical: {same}"
        )
    return lines, ok


def say(text: str) -> None:
    """Print ``text`` in one write, so that ranks sharing a stdout do not interleave lines
    (``print`` writes the text and its newline apart)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--offload", type=int, default=1, help="layers offloaded per stage")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sample")
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="plan each stage for this budget of saved activations: bytes, or '12MiB'",
    )
    parser.add_argument(
        "--copy-bandwidth", type=float, default=None, help="bytes/s (default: measured)"
    )
    args = parser.parse_args()
    args.steps = 1 if args.memory_budget is None else 2  # measured, then planned
    # nccl and cuda:LOCAL_RANK on GPUs, hccl and npu:LOCAL_RANK on NPUs, gloo on the CPU.
    backend, device = distributed_setup(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        expected = run(args, rank, world, device, offload=False)[0]
        actual, indices, handles, peaks = run(args, rank, world, device, offload=True)
    finally:
        dist.destroy_process_group()
    same = len(expected) == len(actual) and all(torch.equal(a, b) for a, b in zip(expected, actual))
    if args.memory_budget is not None:
        lines, ok = budget_lines(args, rank, indices, handles, peaks, same)
        say("".join(line + "\n" for line in lines))
        return 0 if same and ok else 1
    say(
        f"rank {rank}: schedule={args.schedule} microbatches={args.microbatches} "
        f"offload={args.offload}/{args.layers_per_stage} per stage: "
        f"gradients bit-identical: {same}\n"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
