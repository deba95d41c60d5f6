"""FSDP2 (``fully_shard``) with ``offload_layers``: every order and setting, bit for bit.

Run on N processes (gloo on CPU, NCCL where a GPU is)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/fsdp2.py

For each configuration (offload before or after ``fully_shard``, ``reshard_after_forward``
on or off, fp32 or bf16 mixed precision) it trains a small Llama two steps with and
without offload and prints, per rank, whether the local gradient shards and parameters
are bit-identical and how many tensors moved.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from cpu_offload import offload_layers
from cpu_offload.models.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(hidden=64, heads=4, kv_heads=2, ffn=96, layers=4, vocab=128)
ORDERS = ("offload-then-shard", "shard-then-offload")


def build(mesh, order: str, reshard: bool, bf16: bool, k: int):
    torch.manual_seed(0)
    model = Llama(CONFIG)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    handle = None
    if k and order == "offload-then-shard":
        handle = offload_layers(model, k, min_offload_numel=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if k and order == "shard-then-offload":
        handle = offload_layers(model, k, min_offload_numel=0)
    return model, handle


def train(model, rank: int, steps: int = 2) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)  # each rank's own data
        tokens = torch.randint(0, CONFIG.vocab, (2, 33), generator=generator)
        model.loss(tokens).backward()
        local += [p.grad.to_local().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return local + [p.detach().to_local().clone() for p in model.parameters()]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for order, reshard, bf16 in itertools.product(ORDERS, (True, False), (False, True)):
        name = f"{order} reshard_after_forward={reshard} {'bf16' if bf16 else 'fp32'}"
        expected = train(build(mesh, order, reshard, bf16, 0)[0], rank)
        model, handle = build(mesh, order, reshard, bf16, 2)
        actual = train(model, rank)
        same = len(actual) == len(expected) and all(
            torch.equal(a, b) for a, b in zip(actual, expected)
        )
        stats = handle.offload_synchronizer.stats
        print(
            f"rank {rank}/{world}: {name}: bit-identical: {same}, "
            f"offloaded {stats.tensors_offloaded} tensors, reloaded {stats.tensors_reloaded}",
            flush=True,
        )
        handle.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
