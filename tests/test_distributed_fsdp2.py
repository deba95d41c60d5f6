"""examples/fsdp2.py on 1 and 2 processes (gloo, CPU): FSDP2 fully_shard with offload_layers,
both orders, reshard_after_forward on and off, fp32 and bf16 mixed precision."""

from __future__ import annotations

import re

import pytest
from helpers import torchrun

CONFIGS = [
    f"{order} reshard_after_forward={reshard} {dtype}"
    for order in ("offload-then-shard", "shard-then-offload")
    for reshard in (True, False)
    for dtype in ("fp32", "bf16")
]


@pytest.mark.parametrize("world", [1, 2])
def test_fully_shard_composes_bit_identically(world):
    output = torchrun("fsdp2.py", world)
    for rank in range(world):
        for config in CONFIGS:
            line = re.search(
                rf"rank {rank}/{world}: {config}: bit-identical: (\w+), "
                r"offloaded (\d+) tensors, reloaded (\d+)",
                output,
            )
            assert line is not None, f"no line for rank {rank}, {config}:\n{output[-3000:]}"
            same, offloaded, reloaded = line.groups()
            assert same == "True", line.group(0)
            assert int(offloaded) > 0 and offloaded == reloaded, line.group(0)
