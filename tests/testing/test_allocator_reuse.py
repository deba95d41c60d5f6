"""Allocator reuse across streams (NOTE [Allocator reuse across streams]): the peers' bugs
of this kind, planted, are caught by the modeled accelerator and the strict simulator, and
the same programs with ``record_stream`` or the right wait pass."""

from __future__ import annotations

import pytest
import torch
from helpers import modeled_device

from cpu_offload import get_cpu_offload_context
from cpu_offload.bench.config import parse_args
from cpu_offload.bench.peers import PEERS, peer_step
from cpu_offload.bench.simulate import stack_of
from cpu_offload.device.runtime import StreamBackend
from cpu_offload.testing import StreamHazardError, strict_runtime, timed_runtime
from cpu_offload.testing.allocator_pools import FreedBlock, StreamOrder, StreamPools, Use
from cpu_offload.testing.modeled_cuda import modeled_cuda

DEVICE = modeled_device()
FIXES = ("record_stream", "wait")


def packed_on_the_transfer_stream(fix: str | None) -> None:
    """axolotl #3833 (TRL's ``pack_tensor``): a non-contiguous tensor cloned on the
    transfer stream, read by compute, freed, and the transfer stream's next allocation."""
    x = torch.empty(1024, 512, device="meta")
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        transfer, main = torch.cuda.Stream(), torch.cuda.current_stream()
        transfer.wait_stream(main)
        with torch.cuda.stream(transfer):
            packed = x.t().clone()
        main.wait_stream(transfer)
        _ = packed * 2  # compute reads it, queued behind whatever compute runs
        if fix == "record_stream":
            packed.record_stream(main)
        del packed
        if fix == "wait":
            transfer.wait_stream(main)
        with torch.cuda.stream(transfer):
            host = torch.empty(512, 1024, device="cpu", pin_memory=True)
            torch.empty(512, 1024, device="cuda").copy_(host, non_blocking=True)


def reload_buffer_reused(fix: str | None) -> None:
    """DeepSpeed #8186: a reload buffer, written on the copy stream, is freed on compute
    before compute waited for the copy, and compute's next allocation takes its block."""
    host = torch.empty(256, 1024, device="meta")
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        pinned = torch.empty_like(host, device="cpu", pin_memory=True)
        copies, main = torch.cuda.Stream(), torch.cuda.current_stream()
        buffer = torch.empty(256, 1024, device="cuda")  # compute's block
        copies.wait_stream(main)
        with torch.cuda.stream(copies):
            buffer.copy_(pinned, non_blocking=True)
        if fix == "record_stream":
            buffer.record_stream(copies)
        if fix == "wait":
            main.wait_stream(copies)
        del buffer
        _ = torch.empty(256, 1024, device="cuda").fill_(1)


@pytest.mark.parametrize("program", [packed_on_the_transfer_stream, reload_buffer_reused])
def test_the_peers_planted_reuse_is_caught_and_the_fixed_programs_pass(program):
    with pytest.raises(StreamHazardError) as caught:
        program(None)
    message = str(caught.value)
    assert message.startswith("modeled_cuda: a tensor (shape ")
    assert "reuses the block of a tensor (shape " in message
    assert "record_stream(" in message and "wait for" in message
    if program is packed_on_the_transfer_stream:
        # the block's stream, the reader's stream, both tensors
        assert "(shape (512, 1024), dtype torch.float32), allocated on side stream" in message
        assert "the pool of side stream" in message and "compute's aten.mul.Tensor" in message
    else:
        assert "allocated on compute" in message and "(the pool of compute)" in message
        assert "side stream" in message and "copy into of that tensor" in message
    for fix in FIXES:
        program(fix)


def freed_after_a_read_by_compute(x: torch.Tensor) -> torch.cuda.Stream:
    """Under ``modeled_cuda``: ``x.t()`` cloned on a transfer stream, read by compute and
    freed, without ``record_stream``; the transfer stream."""
    transfer = torch.cuda.Stream()
    with torch.cuda.stream(transfer):
        packed = x.t().clone()
    torch.cuda.current_stream().wait_stream(transfer)
    _ = packed * 2
    del packed
    return transfer


def test_a_host_synchronisation_orders_the_reuse():
    x = torch.empty(1024, 512, device="meta")
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        transfer = freed_after_a_read_by_compute(x)
        torch.cuda.synchronize()
        with torch.cuda.stream(transfer):
            torch.empty(512, 1024, device="cuda").fill_(0)


def test_another_streams_pool_is_not_reused_and_a_smaller_block_splits():
    x = torch.empty(1024, 512, device="meta")
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        transfer = freed_after_a_read_by_compute(x)
        _ = torch.empty(512, 1024, device="cuda")  # compute's own pool: no reuse
        with torch.cuda.stream(transfer), pytest.raises(StreamHazardError, match="reuses"):
            torch.empty(384, 1024, device="cuda")  # most of the freed block


def strict_packed(runtime, fix: str | None) -> None:
    x = torch.randn(256, 128)
    transfer, main = runtime.Stream(), runtime.current_stream()
    transfer.wait_stream(main)
    with runtime.stream(transfer):
        packed = x.t().clone()
    main.wait_stream(transfer)
    doubled = packed * 2
    if fix == "record_stream":
        runtime.sim.record_stream(packed, runtime.sim.compute)
    del packed
    if fix == "wait":
        transfer.wait_stream(main)
    with runtime.stream(transfer):
        again = torch.empty(128, 256)
        again.copy_(x.t())
    runtime.synchronize()
    torch.testing.assert_close(doubled, 2 * x.t())


def test_the_strict_simulator_models_the_pools_too():
    with strict_runtime("cuda") as runtime, pytest.raises(StreamHazardError) as caught:
        strict_packed(runtime, None)
    message = str(caught.value)
    assert message.startswith("strict_streams: tensor (shape (128, 256), dtype torch.float32)")
    assert "the pool of side stream" in message and "compute's aten.mul.Tensor" in message
    for fix in FIXES:
        with strict_runtime("cuda") as runtime:
            strict_packed(runtime, fix)
            assert runtime.sim.pools.reuses == 1


def test_pools_best_fit_and_vector_clocks():
    order = StreamOrder()
    pools = StreamPools(order.ordered, "test")
    a, b, c = "a", "b", "c"
    seq = order.tick(b)
    pools.free(a, FreedBlock(4096, "a", "old", {b: Use(b, "b", seq, "read")}))
    pools.free(a, FreedBlock(2048, "a", "harmless"))
    pools.allocate(a, 1500, "new", "a")  # best fit: the harmless block
    with pytest.raises(StreamHazardError, match="while b's read of that tensor is pending"):
        pools.allocate(a, 1500, "new", "a")
    # transitively ordered: a waits for c, which waited for b
    pools.free(a, FreedBlock(4096, "a", "old", {b: Use(b, "b", seq, "read")}))
    order.wait(c, order.stamp(b))
    order.wait(a, order.stamp(c))
    pools.allocate(a, 4096, "new", "a")
    assert pools.reuses == 3


@pytest.mark.parametrize("peer", ["torchtune", "trl"])
def test_the_installed_peers_run_unmodified_with_their_blocks_reused(peer):
    pytest.importorskip(PEERS[peer].module.split(".")[0])
    config = parse_args(["--preset", "tiny", "--layers", "3", "--seq", "128"])
    layers, x, _ = stack_of(config)
    run = peer_step(peer, layers, x, "h100")
    assert run.d2h_bytes > 0 and run.block_reuses > 0  # reuses happened, each checked


def prefetched_on_compute_popped_on_another_stream(slice_bytes: int | None = None) -> int:
    """The manual controller reloads every layer on compute (whole, or its first slice
    with ``slice_bytes``); backward runs on another stream, so the reloaded tensors are
    read there; compute then allocates again."""
    layers = [torch.nn.Linear(512, 512, device="meta") for _ in range(3)]
    x = torch.empty(1024, 512, device="meta", requires_grad=True)
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        ctx, sync_fn, controller = get_cpu_offload_context(
            True, model_layers=3, manual_synchronization=True, reload_slice_bytes=slice_bytes
        )
        h = x
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h).relu()
            h = sync_fn(h)
            controller.start_offload_layer(i)
        for i in range(3):
            controller.release_activation_forward_gpu_memory(i)
        for i in reversed(range(3)):
            controller.start_reload_layer(i)
        other = torch.cuda.Stream()
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            h.sum().backward()
        for _ in range(4):
            torch.empty(1024, 512, device="cuda").fill_(0)
    return run.block_reuses


@pytest.mark.parametrize("slice_bytes", [None, 2**20], ids=["whole", "sliced"])
def test_a_reloaded_tensor_popped_on_another_stream_is_recorded_for_it(monkeypatch, slice_bytes):
    assert prefetched_on_compute_popped_on_another_stream(slice_bytes) > 0
    monkeypatch.setattr(StreamBackend, "record_stream", lambda self, tensor, stream: None)
    with pytest.raises(StreamHazardError, match="allocated on compute, reuses the block"):
        prefetched_on_compute_popped_on_another_stream(slice_bytes)
