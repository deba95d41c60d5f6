"""Pinned memory under the modeled ``torch.cuda`` is counted as torch 2.13's caching host
allocator holds it (NOTE [Modeled pinned memory])."""

from __future__ import annotations

import torch

from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda
from cpu_offload.testing.pinned_memory import PinnedCache, held_bytes, round_threshold

MIB = 2**20


def test_a_pinned_request_holds_the_next_power_of_two_and_its_block_is_cached():
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        first = torch.empty(600 * MIB, dtype=torch.uint8, pin_memory=True)
        del first
        again = torch.empty(700 * MIB, dtype=torch.uint8, pin_memory=True)  # same block
        other = torch.empty(3 * MIB, dtype=torch.uint8, pin_memory=True)  # a new one
        del again, other
    assert run.host_peak_bytes == 1024 * MIB + 4 * MIB
    assert run.pinned_reserved_bytes == 1028 * MIB
    assert run.pinned_allocations == 2


def test_the_round_threshold_setting_holds_larger_requests_at_their_size(monkeypatch):
    getter = "_accelerator_getAllocatorSettings"
    monkeypatch.setattr(torch._C, getter, lambda: "pinned_max_round_threshold_mb:64")
    assert round_threshold() == 64 * MIB
    with timed_runtime("h100") as run, modeled_cuda(run.live):
        big = torch.empty(600 * MIB + 1, dtype=torch.uint8, pin_memory=True)
        small = torch.empty(33 * MIB, dtype=torch.uint8, pin_memory=True)
        del big, small
    assert run.pinned_reserved_bytes == 600 * MIB + 512 + 64 * MIB
    monkeypatch.setattr(torch._C, getter, lambda: "")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert round_threshold() is None


def test_held_bytes_and_the_cache():
    assert [held_bytes(n, None) for n in (1, 512, 513, 3 * MIB)] == [1, 512, 1024, 4 * MIB]
    assert held_bytes(3 * MIB + 1, MIB) == 3 * MIB + 512
    cache = PinnedCache(None)
    sizes = [cache.allocate(n) for n in (5 * MIB, 6 * MIB)]
    assert sizes == [8 * MIB, 8 * MIB] and cache.allocations == 2
    cache.release(sizes[0])
    assert cache.allocate(7 * MIB) == 8 * MIB and cache.allocations == 2
    assert cache.reserved == cache.peak_reserved == 16 * MIB == cache.in_use


def test_emptying_the_cache_gives_back_the_free_blocks():
    cache = PinnedCache(MIB)
    sizes = [cache.allocate(n) for n in (5 * MIB + 1, 6 * MIB)]
    assert sizes == [5 * MIB + 512, 6 * MIB]
    cache.release(sizes[0])
    cache.empty_cache()
    assert (cache.reserved, cache.in_use, cache.peak_reserved) == (6 * MIB, 6 * MIB, 11 * MIB + 512)
    assert cache.allocate(5 * MIB + 1) == 5 * MIB + 512 and cache.allocations == 3
