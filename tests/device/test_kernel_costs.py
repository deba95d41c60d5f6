"""What an operator costs a device: FLOPs by torch's formulas, bytes read and written."""

from __future__ import annotations

import torch

from cpu_offload.device.kernel_costs import kernel_cost, memory_bytes

aten = torch.ops.aten


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_a_matmul_costs_its_flops_and_its_operands():
    a, b = meta(128, 64), meta(64, 32)
    out = aten.mm.default(a, b)
    assert kernel_cost(aten.mm.default, (a, b), {}, out) == (
        2 * 128 * 64 * 32,
        2 * (8192 + 2048 + 4096),
    )


def test_elementwise_work_costs_bytes_and_broadcasts_are_read_once():
    x, weight = meta(1024, 256), meta(256)
    out = aten.mul.Tensor(x, weight)  # the weight is broadcast over 1024 rows
    assert kernel_cost(aten.mul.Tensor, (x, weight), {}, out) == (0, 2 * (2 * 1024 * 256 + 256))
    assert memory_bytes(weight.expand(1024, 256)) == 2 * 256


def test_in_place_work_reads_and_writes_its_tensor():
    x = meta(1024)
    assert kernel_cost(aten.mul_.Scalar, (x, 2.0), {}, x) == (0, 2 * 2 * 1024)


def test_views_aliases_and_allocations_launch_nothing():
    x = meta(16, 64)
    assert kernel_cost(aten.view.default, (x, [64, 16]), {}, x.view(64, 16)) is None
    assert kernel_cost(aten.detach.default, (x,), {}, x.detach()) is None
    flat = aten._unsafe_view.default(x, [1024])
    assert kernel_cost(aten._unsafe_view.default, (x, [1024]), {}, flat) is None
    assert kernel_cost(aten.empty.memory_format, ([8],), {}, meta(8)) is None
