"""Activation offload inside pipeline-parallel stages (torch.distributed.pipelining).

Run on two processes (CPU and gloo, GPUs and nccl, or Ascend NPUs and hccl):

    torchrun --standalone --nproc-per-node 2 examples/pipeline_parallel.py
    torchrun --standalone --nproc-per-node 2 examples/pipeline_parallel.py --schedule interleaved

Each stage offloads the activations of its first ``--offload`` layers. Several
micro-batches are in flight in each stage (1F1B), and every forward pass owns its own
layer states, so nothing a later backward needs is freed early. The script trains one
step with and one without offload and checks that every rank's gradients are
bit-identical (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from cpu_offload import offload_layers
from cpu_offload.device.runtime import distributed_setup
from cpu_offload.models.llama import LlamaConfig, LlamaLayer

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


def run(args, rank: int, world: int, device, offload: bool) -> list[torch.Tensor]:
    per_rank = 2 if args.schedule == "interleaved" else 1
    stages = build_stages(rank, world, per_rank, args.layers_per_stage, device)
    handles = [
        offload_layers(module.layers, args.offload, min_offload_numel=0, device=device)
        for _, module in stages
        if offload
    ]
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
    x = torch.randn(2 * args.microbatches, 16, CONFIG.hidden, generator=generator).to(device)
    target = torch.randn(x.shape, generator=generator).to(device)
    has_first = any(index == 0 for index, _ in stages)
    has_last = any(index == world * per_rank - 1 for index, _ in stages)
    schedule.step(*([x] if has_first else []), **({"target": target} if has_last else {}))
    for handle in handles:
        stats = handle.offload_synchronizer.stats
        if stats.tensors_offloaded == 0:
            raise RuntimeError("the offloaded run moved nothing to the host")
        handle.remove()
    return [p.grad.detach().clone() for _, module in stages for p in module.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--offload", type=int, default=2, help="layers offloaded per stage")
    args = parser.parse_args()
    # nccl and cuda:LOCAL_RANK on GPUs, hccl and npu:LOCAL_RANK on NPUs, gloo on the CPU.
    backend, device = distributed_setup(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        expected = run(args, rank, world, device, offload=False)
        actual = run(args, rank, world, device, offload=True)
    finally:
        dist.destroy_process_group()
    same = len(expected) == len(actual) and all(torch.equal(a, b) for a, b in zip(expected, actual))
    print(
        f"rank {rank}: schedule={args.schedule} microbatches={args.microbatches} "
        f"offload={args.offload}/{args.layers_per_stage} per stage: "
        f"gradients bit-identical: {same}",
        flush=True,
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
