"""The host memory pool stays bounded by the peak need, whatever the shapes."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_bit_identical, forward, make_layers

from cpu_offload import get_cpu_offload_context
from cpu_offload.device.backend import HostBackend
from cpu_offload.engine.host_buffers import MIN_BLOCK_BYTES, HostBufferPool, size_class

WIDTH = 32
MiB = 2**20


def _input(seq: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, seq, WIDTH, generator=generator).requires_grad_()


def _offloaded_bytes(synchronizer, run) -> int:
    before = synchronizer.stats.bytes_offloaded
    run()
    return synchronizer.stats.bytes_offloaded - before


def test_size_classes_are_powers_of_two_from_the_smallest_block():
    assert size_class(1) == MIN_BLOCK_BYTES
    assert size_class(MIN_BLOCK_BYTES + 1) == 2 * MIN_BLOCK_BYTES
    assert size_class(3 * MiB) == 4 * MiB
    assert size_class(4 * MiB) == 4 * MiB


def test_views_have_the_requested_layout_and_do_not_overlap():
    pool = HostBufferPool(HostBackend(), retain=False)
    tensors = [
        torch.randn(3, 5),
        torch.randn(4, 6).t(),  # permuted: dense with its own strides
        torch.zeros(7, dtype=torch.bool),
        torch.randn(2, 3, dtype=torch.complex64),
    ]
    buffers = pool.acquire(0, tensors)
    for buffer, tensor in zip(buffers, tensors):
        assert (buffer.shape, buffer.stride(), buffer.dtype) == (
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        buffer.copy_(tensor)
    for buffer, tensor in zip(buffers, tensors):
        assert torch.equal(buffer, tensor)  # no buffer wrote into another
    assert pool.stats()["requested_bytes"] == sum(t.numel() * t.element_size() for t in tensors)
    pool.release(0, buffers)
    stats = pool.stats()
    assert stats["in_use_bytes"] == stats["requested_bytes"] == 0
    assert stats["reserved_bytes"] == 4 * MIN_BLOCK_BYTES


def test_a_smaller_request_reuses_a_larger_free_block():
    pool = HostBufferPool(HostBackend(), retain=False)
    pool.release(0, pool.acquire(0, [torch.empty(100_000)]))
    assert pool.allocations == 1
    pool.release(0, pool.acquire(0, [torch.empty(3_000)]))
    assert pool.allocations == 1


def test_random_sequence_lengths_keep_the_pool_bounded(streams):
    """200 steps with random lengths 16-512: the pool stays within 2x one step's need."""
    layers = make_layers("transformer", 4, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    rng = random.Random(0)
    largest_step = 0
    allocations = []
    for step in range(200):
        x = _input(rng.randint(16, 512), step)
        moved = _offloaded_bytes(
            synchronizer, lambda x=x: forward(layers, x, ctx, sync_fn).sum().backward()
        )
        largest_step = max(largest_step, moved)
        allocations.append(synchronizer.host_memory_stats()["num_host_alloc"])
    stats = synchronizer.host_memory_stats()
    assert stats["in_use_bytes"] == 0
    assert stats["reserved_bytes"] <= 2 * largest_step + MiB, (stats, largest_step)
    assert stats["num_host_alloc"] - stats["num_host_free"] > 0
    # Allocations stop: once the largest shapes were seen, later steps allocate nothing.
    assert allocations[-1] == allocations[100], allocations[95:]


def test_a_block_too_small_for_every_request_is_freed_when_the_bound_needs_room():
    pool = HostBufferPool(HostBackend(), retain=False)
    pool.release(0, pool.acquire(0, [torch.empty(3 * MiB, dtype=torch.uint8)]))  # a 4 MiB block
    pool.release(0, pool.acquire(0, [torch.empty(5 * MiB, dtype=torch.uint8)]))  # needs 8 MiB
    stats = pool.stats()
    assert (stats["num_host_alloc"], stats["num_host_free"]) == (2, 1)
    assert stats["reserved_bytes"] == 8 * MiB <= 2 * stats["peak_requested_bytes"]


def test_growing_sequence_lengths_stay_within_the_bound(streams):
    layers = make_layers("transformer", 4, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    moved = []
    for step, seq in enumerate((16, 64, 256, 1024)):
        x = _input(seq, step)
        moved.append(
            _offloaded_bytes(
                synchronizer, lambda x=x: forward(layers, x, ctx, sync_fn).sum().backward()
            )
        )
    assert synchronizer.host_memory_stats()["reserved_bytes"] <= 2 * moved[-1] + MiB


def test_dropped_forwards_return_their_buffers(streams):
    """50 validation forwards with grad enabled leave the pool where one step leaves it."""
    layers = make_layers("transformer", 4, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    x = _input(128, 0)
    forward(layers, x, ctx, sync_fn).sum().backward()
    after_one_step = synchronizer.host_memory_stats()
    for _ in range(50):
        out = forward(layers, x, ctx, sync_fn)
        assert synchronizer.host_memory_stats()["in_use_bytes"] > 0
        del out
    assert synchronizer.host_memory_stats() | {"peak_requested_bytes": 0} == after_one_step | {
        "peak_requested_bytes": 0
    }


def test_empty_cache_frees_the_free_blocks_and_keeps_working(streams):
    layers = make_layers("transformer", 2, WIDTH, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    x = _input(64, 0)
    layers.zero_grad()
    forward(layers, x, ctx, sync_fn).sum().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    before = synchronizer.host_memory_stats()
    synchronizer.host_buffers.empty_cache()
    stats = synchronizer.host_memory_stats()
    assert stats["reserved_bytes"] == 0
    assert stats["num_host_free"] == before["num_host_alloc"]
    layers.zero_grad()
    forward(layers, x, ctx, sync_fn).sum().backward()
    assert_bit_identical(expected, [p.grad.clone() for p in layers.parameters()])
    assert synchronizer.host_memory_stats()["reserved_bytes"] == before["reserved_bytes"]


@pytest.mark.parametrize("retain", [False, True])
def test_stats_count_retained_buffers(streams, retain):
    layers = make_layers("mlp", 3, 8, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(
        True, 2, 3, min_offload_numel=0, retain_pinned_cpu_buffers=retain
    )
    synchronizer = ctx.offload_synchronizer
    x = torch.randn(16, 8, requires_grad=True)
    for _ in range(3):
        forward(layers, x, ctx, sync_fn).sum().backward()
    stats = synchronizer.host_memory_stats()
    assert stats["num_host_alloc"] == 2 * 3  # two layers, three saved tensors each
    assert stats["reserved_bytes"] == 6 * MIN_BLOCK_BYTES
    assert stats["in_use_bytes"] == (6 * MIN_BLOCK_BYTES if retain else 0)
    synchronizer.host_buffers.empty_cache()
    assert synchronizer.host_memory_stats()["reserved_bytes"] == 0


@pytest.mark.parametrize("cap_fraction", [0.0, 0.3, 0.7], ids=["cap0", "cap30", "cap70"])
def test_max_host_bytes_below_the_need_keeps_gradients_and_the_cap(streams, cap_fraction):
    layers = make_layers("mlp", 4, WIDTH, torch.float32)
    plain, need = [], None
    for step in range(4):
        layers.zero_grad()
        forward(layers, _input(64 + 16 * step, step)).sum().backward()
        plain.append([p.grad.clone() for p in layers.parameters()])
    probe, probe_sync = get_cpu_offload_context(True, 3, 4, min_offload_numel=0)
    forward(layers, _input(64 + 16 * 3, 3), probe, probe_sync).sum().backward()
    need = probe.offload_synchronizer.host_memory_stats()["reserved_bytes"]
    cap = int(need * cap_fraction)
    ctx, sync_fn = get_cpu_offload_context(True, 3, 4, min_offload_numel=0, max_host_bytes=cap)
    synchronizer = ctx.offload_synchronizer
    with pytest.warns(UserWarning, match=rf"the host buffer pool is at max_host_bytes={cap} "):
        for step in range(4):
            layers.zero_grad()
            forward(layers, _input(64 + 16 * step, step), ctx, sync_fn).sum().backward()
            assert_bit_identical(plain[step], [p.grad.clone() for p in layers.parameters()])
            assert synchronizer.host_memory_stats()["reserved_bytes"] <= cap
    stats = synchronizer.stats
    assert stats.tensors_kept_by_host_cap > 0 and stats.bytes_kept_by_host_cap > 0
    assert (stats.tensors_offloaded > 0) == (cap_fraction > 0)
    assert "kept on the device by max_host_bytes" in str(stats)


@pytest.mark.parametrize(
    "value, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)], ids=str
)
def test_max_host_bytes_must_be_bytes(value, error):
    with pytest.raises(error, match="max_host_bytes must be"):
        get_cpu_offload_context(True, 1, 2, max_host_bytes=value)


def test_free_blocks_are_kept_per_size_class_so_lending_is_o1_in_blocks():
    pool = HostBufferPool(HostBackend(), retain=False)
    like = [torch.empty(1024) for _ in range(2000)]  # 4 KiB each: one class
    lent = pool.acquire(0, like)
    pool.release(0, lent)
    assert pool._free_sizes == [4096] and len(pool._free[4096]) == 2000
    again = pool.acquire(0, like[:1])  # taken from the class's list, not a sorted scan
    assert pool._free_sizes == [4096] and len(pool._free[4096]) == 1999
    pool.release(0, again)
    assert pool.stats()["num_host_alloc"] == 2000


@pytest.mark.parametrize(
    "widths, cap",
    [
        ([64, 256, 32, 256, 32, 64], 3 * MIN_BLOCK_BYTES),
        ([128, 16, 16, 32, 32], MIN_BLOCK_BYTES),
        ([32, 64, 128, 16, 16], 3 * MIN_BLOCK_BYTES),
        ([256, 256, 32, 64, 128], 7 * MIN_BLOCK_BYTES),
    ],
    ids=["wide-narrow", "first-too-large", "eviction-no-room", "mixed"],
)
def test_max_host_bytes_with_fixed_shapes_allocates_nothing_after_the_first_step(widths, cap):
    """Under the cap, a tensor that cannot fit (its block is over the cap, or evicting
    every free block would not make room) is refused without freeing blocks that later
    tensors of the step reuse: with fixed shapes the pool stops allocating."""
    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU())
        for a, b in zip(widths, widths[1:])
    ]
    count = len(layers)
    with pytest.warns(UserWarning, match="max_host_bytes"):
        ctx, sync_fn = get_cpu_offload_context(
            True, count - 1, count, min_offload_numel=0, max_host_bytes=cap
        )
        allocations = []
        for _ in range(5):
            forward(layers, torch.randn(16, widths[0]), ctx, sync_fn).sum().backward()
            allocations.append(ctx.offload_synchronizer.host_memory_stats()["num_host_alloc"])
    assert allocations[0] > 0 and allocations == [allocations[0]] * 5, allocations


def test_a_tensor_whose_block_exceeds_max_host_bytes_evicts_nothing():
    pool = HostBufferPool(HostBackend(), retain=False, max_bytes=2 * MIN_BLOCK_BYTES)
    small = torch.empty(MIN_BLOCK_BYTES // 4)  # fp32: one block
    pool.release(0, pool.acquire(0, [small]))
    assert pool.stats()["reserved_bytes"] == MIN_BLOCK_BYTES  # free, cached
    with pytest.warns(UserWarning, match="max_host_bytes"):
        assert pool.acquire(1, [torch.empty(MIN_BLOCK_BYTES)]) == [None]  # a 16 KiB block
    assert pool.stats()["reserved_bytes"] == MIN_BLOCK_BYTES and pool.stats()["num_host_free"] == 0
