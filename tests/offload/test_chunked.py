"""A whole forward under one context: chunks by bytes, torchtune's OffloadActivations."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from cpu_offload import is_cpu_offload_enabled
from cpu_offload.chunked import ChunkedOffload
from cpu_offload.integrations.torchtune import OffloadActivations

pytestmark = pytest.mark.usefixtures("streams")


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk_bytes", [1, 4096, 2**30], ids=["per-tensor", "4KiB", "one"])
def test_gradients_are_bit_identical_and_all_but_the_last_chunk_moves(chunk_bytes):
    x = torch.randn(16, 32, requires_grad=True)
    plain = make_model()
    plain(x).square().sum().backward()
    model = make_model()
    ctx = ChunkedOffload(chunk_bytes, min_offload_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default use warns about nothing
        for _ in range(2):  # a second step reuses the context
            model.zero_grad()
            with ctx:
                assert is_cpu_offload_enabled()
                loss = model(x).square().sum()
            assert not is_cpu_offload_enabled()
            loss.backward()
            assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(model)))
    stats = ctx.offload_synchronizer.stats
    # 13 pushes of 2 KiB a step: x, each block's tanh output twice (by the tanh and by the
    # next Linear, or by square), x once; one chunk each, or two per 4 KiB chunk (7
    # chunks), or one chunk: all but the last chunk move.
    moved_per_step = {1: 12, 4096: 12, 2**30: 0}[chunk_bytes]
    assert stats.tensors_offloaded == stats.tensors_reloaded == 2 * moved_per_step
    assert stats.on_demand_reloads == 0  # every chunk was prefetched by the one after it
    assert stats.forward_passes == 2
    assert ctx.offload_synchronizer.host_memory_stats()["in_use_bytes"] == 0


def test_retain_graph_and_a_second_backward():
    x = torch.randn(16, 32, requires_grad=True)
    plain = make_model()
    loss = plain(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    model = make_model()
    with ChunkedOffload(1, min_offload_numel=0):
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(model)))


def test_a_backward_output_that_is_a_view_of_a_popped_tensor_stays_valid():
    """A custom Function returns a view of its saved tensor as its gradient; the chunk
    that tensor came from must not be reused while the view flows on."""

    class GradIsSavedView(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward((t * 3).t())
            return t.sum(dim=1)

        @staticmethod
        def backward(ctx, grad):
            (saved,) = ctx.saved_tensors
            return saved.t() * grad[:, None]

    def run(ctx):
        x = torch.full((64, 64), 2.0, requires_grad=True)
        with ctx:
            h = x.exp()  # a chunk of its own
            y = GradIsSavedView.apply(h)
            z = (y * torch.arange(64.0)).tanh()
        z.sum().backward()
        return x.grad

    import contextlib

    assert torch.equal(run(contextlib.nullcontext()), run(ChunkedOffload(1, min_offload_numel=0)))


def test_an_exception_in_the_forward_frees_everything():
    model = make_model()
    ctx = ChunkedOffload(1, min_offload_numel=0)
    outputs: list[StorageWeakRef] = []
    for block in model:
        block.register_forward_hook(
            lambda m, a, out: outputs.append(StorageWeakRef(out.untyped_storage()))
        )
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with ctx:
                h = model(torch.randn(16, 32, requires_grad=True))
                raise RuntimeError("boom")
        del h
        assert all(ref.expired() for ref in outputs)
        assert ctx.offload_synchronizer.host_memory_stats()["in_use_bytes"] == 0
        assert not is_cpu_offload_enabled()
    finally:
        gc.enable()


def test_offload_activations_takes_torchtunes_constructor():
    ctx = OffloadActivations(
        use_pin_memory=False, use_streams=False, max_fwd_stash_size=2, min_offload_size=4096
    )
    assert ctx.offload_synchronizer.min_offload_bytes == 4096
    ctx.fwd_stash = {}  # torchtune's tests poke this; harmless
    for wrong, error in (
        (dict(use_streams="yes"), TypeError),
        (dict(max_fwd_stash_size=0), ValueError),
        (dict(max_fwd_stash_size=1.5), TypeError),
    ):
        with pytest.raises(error, match="OffloadActivations: "):
            OffloadActivations(**wrong)


def test_offload_activations_with_the_byte_threshold():
    x = torch.randn(16, 32, requires_grad=True)
    model = make_model()
    small = OffloadActivations(min_offload_size=4096, chunk_bytes=1)  # 2 KiB tensors stay
    with small:
        model(x).sum().backward()
    assert small.offload_synchronizer.stats.tensors_offloaded == 0
    moving = OffloadActivations(min_offload_size=2048, chunk_bytes=1)
    with moving:
        loss = model(x).sum()
    loss.backward()
    assert moving.offload_synchronizer.stats.tensors_offloaded == 11


def test_the_drop_in_default_warns_nothing_and_takes_trls_keywords():
    from cpu_offload.integrations.torchtune import get_act_offloading_ctx_manager

    model = nn.Module()
    model.layers = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default k = L - 1 is not the caller's choice
        ctx = get_act_offloading_ctx_manager(model, True)
        trl = get_act_offloading_ctx_manager(
            model=model,
            use_pin_memory=True,
            use_streams=True,
            min_offload_size=2048,
            max_fwd_stash_size=5,
            warn_if_no_head=False,
        )
    ctx.remove()
    x = torch.randn(16, 32, requires_grad=True)
    with trl:
        h = x
        for layer in model.layers:
            h = layer(h)
    h.sum().backward()
    assert trl.offload_synchronizer.min_offload_bytes == 2048
    assert trl.offload_synchronizer.stats.tensors_offloaded > 0
    trl.remove()


def test_entering_twice_is_an_error_and_leaves_the_first_entry_working():
    from cpu_offload import CpuOffloadError

    model = make_model()
    ctx = ChunkedOffload(1, min_offload_numel=0)
    with ctx:
        with pytest.raises(CpuOffloadError, match="entered again before it was left"):
            ctx.__enter__()
        loss = model(torch.randn(16, 32, requires_grad=True)).sum()
    loss.backward()
    assert ctx.offload_synchronizer.stats.tensors_offloaded > 0
    assert not is_cpu_offload_enabled()
