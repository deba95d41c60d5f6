"""What an operator costs a device: FLOPs by torch's formulas, bytes read and written."""

from __future__ import annotations

import torch

from cpu_offload.device.kernel_costs import attention_flops, kernel_cost, memory_bytes

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


def test_grouped_query_attention_counts_every_query_head():
    # 32 query heads over 8 key/value heads: each query head does a full attention.
    q, kv = meta(1, 32, 256, 128), meta(1, 8, 256, 128)
    out = aten._scaled_dot_product_flash_attention(q, kv, kv)
    flops, _ = kernel_cost(aten._scaled_dot_product_flash_attention.default, (q, kv, kv), {}, out)
    assert flops == attention_flops(q.shape, q.shape, q.shape) == 2 * (2 * 32 * 256 * 256 * 128)


def test_the_census_counts_grouped_attention_without_torchs_own_formula(monkeypatch):
    # torch before 2.13 (the H100 image's 2.11) asserts on grouped heads in its formula;
    # the census must not depend on it.
    from torch.utils import flop_counter

    from cpu_offload.models.llama import LlamaConfig, LlamaLayer
    from cpu_offload.plan.census import measure_layer

    def rejects(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    config = LlamaConfig(hidden=256, heads=8, kv_heads=2, ffn=512, layers=1)
    x = meta(1, 64, 256)
    expected = measure_layer(lambda: LlamaLayer(config).to(torch.bfloat16), x)
    for op in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
    ):
        monkeypatch.setitem(flop_counter.flop_registry, getattr(aten, op), rejects)
    measured = measure_layer(lambda: LlamaLayer(config).to(torch.bfloat16), x)
    attention = attention_flops((1, 8, 64, 32), (1, 8, 64, 32), (1, 8, 64, 32))
    assert attention > 0 and expected.forward_flops > attention
    assert (measured.forward_flops, measured.backward_flops) == (
        expected.forward_flops,
        expected.backward_flops,
    )
