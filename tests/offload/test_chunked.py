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


@pytest.mark.parametrize(
    "chunk_bytes", [None, 1, 4096, 2**30], ids=["default", "per-tensor", "4KiB", "one"]
)
def test_gradients_are_bit_identical_and_all_but_the_last_chunk_moves(chunk_bytes):
    x = torch.randn(16, 32, requires_grad=True)
    plain = make_model()
    plain(x).square().sum().backward()
    model = make_model()
    ctx = ChunkedOffload(chunk_bytes, min_offload_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a second step reuses the context
            model.zero_grad()
            with ctx:
                assert is_cpu_offload_enabled()
                loss = model(x).square().sum()
            assert not is_cpu_offload_enabled()
            loss.backward()
            assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(model)))
    stats = ctx.offload_synchronizer.stats
    # 13 saves of 2 KiB a step, 7 distinct tensors: x, and each block's tanh output,
    # saved twice (by the tanh and by the next Linear, or by square) and copied once.
    # Growing chunks (the default) and chunks of 1 byte hold one distinct tensor each,
    # 4 KiB chunks two; one chunk of 1 GiB holds all.  All but the last chunk move, and
    # by default the last too: it holds 1/7 of the forward, over an eighth.
    moved_per_step = {None: 7, 1: 6, 4096: 6, 2**30: 0}[chunk_bytes]
    assert stats.tensors_offloaded == stats.tensors_reloaded == 2 * moved_per_step
    assert stats.bytes_offloaded == 2 * moved_per_step * 16 * 32 * 4
    assert stats.on_demand_reloads == 0  # every chunk was prefetched by the one after it
    assert stats.forward_passes == 2
    assert ctx.offload_synchronizer.host_memory_stats()["in_use_bytes"] == 0
    messages = [str(w.message) for w in caught]
    if moved_per_step:
        assert messages == []  # a forward that moves says nothing
    else:  # one warning, once, saying why nothing moved
        assert len(messages) == 1 and "ChunkedOffload moved nothing" in messages[0]
        assert "fit in one chunk, the last" in messages[0]
        assert "Pass a chunk_bytes under 1073741824" in messages[0]


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
    with pytest.warns(UserWarning, match="each is under min_offload_size=4096 bytes"):
        with small:
            model(x).sum().backward()
    assert small.offload_synchronizer.stats.tensors_offloaded == 0
    moving = OffloadActivations(min_offload_size=2048, chunk_bytes=1)
    with moving:
        loss = model(x).sum()
    loss.backward()
    # x and the 6 tanh outputs (each saved twice but the last, copied once), the last stays
    assert moving.offload_synchronizer.stats.tensors_offloaded == 6


def test_the_drop_in_default_warns_nothing_and_takes_trls_keywords():
    from cpu_offload.integrations.torchtune import get_act_offloading_ctx_manager

    model = nn.Module()
    model.layers = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default k = L - 1 is not the caller's choice
        ctx = get_act_offloading_ctx_manager(model, True)
        ctx.remove()  # one offloader hooks a layer at a time
        trl = get_act_offloading_ctx_manager(
            model=model,
            use_pin_memory=True,
            use_streams=True,
            min_offload_size=2048,
            max_fwd_stash_size=5,
            warn_if_no_head=False,
        )
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


# ------------------------------------------------ what moves at the defaults (issue 30)


def saved_bytes(run) -> tuple[int, int]:
    """Bytes of the distinct offloadable tensors ``run()`` saves, and of the last one."""
    seen: dict[int, int] = {}

    def pack(t):
        if type(t) is torch.Tensor and not isinstance(t, nn.Parameter) and t._base is None:
            seen.setdefault(id(t), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values()), list(seen.values())[-1]


@pytest.mark.parametrize("width, depth", [(32, 6), (256, 24)], ids=["64KiB", "12MiB"])
def test_offload_activations_moves_most_bytes_at_its_defaults_from_the_first_step(width, depth):
    """TRL's and torchtune's users expect everything above min_offload_size to move:
    at the defaults all but the last chunk (about an eighth of the forward) moves, on a
    forward far under the largest chunk, from the first step, and gradients are exact."""
    torch.manual_seed(0)
    blocks = (nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
    model = nn.Sequential(*blocks)
    x = torch.randn(64, width, requires_grad=True)
    total, last = saved_bytes(lambda: model(x).sum())
    plain = [g.clone() for g in torch.autograd.grad(model(x).sum(), [x, *model.parameters()])]
    ctx = OffloadActivations()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # moving says nothing
        with ctx:
            loss = model(x).sum()
        engine = ctx.offload_synchronizer
        stats = engine.stats
        # on the device at the end of forward: at most an eighth of the forward, plus one tensor
        assert total - stats.bytes_offloaded <= total / 8 + last, (total, stats.bytes_offloaded)
        assert engine.get_offloaded_total_size_mb() * 2**20 == stats.bytes_offloaded
        got = torch.autograd.grad(loss, [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert stats.bytes_reloaded == stats.bytes_offloaded > 0


def test_a_tensor_saved_in_several_chunks_is_copied_once():
    """q, k and v of one input, saved in three chunks: the input moves once (NOTE [A
    tensor saved in several chunks]); modified in place in between, it is saved anew
    (and backward raises autograd's error, as without offload)."""
    import contextlib

    torch.manual_seed(0)
    wq, wk, wv = (nn.Parameter(torch.randn(64, 64)) for _ in range(3))

    def run(modify: bool, ctx) -> list[torch.Tensor]:
        torch.manual_seed(1)
        with ctx:
            x = torch.randn(64, 64, requires_grad=True) * 1.0
            q = (x @ wq).sin()  # saves x, then the product: x's chunk closes
            k = (x @ wk).sin()  # x again, in a later chunk
            if modify:
                x.mul_(2)
            v = (x @ wv).sin()
            loss = (q * k * v).sum()
        return [g.clone() for g in torch.autograd.grad(loss, [wq, wk, wv])]

    plain = run(False, contextlib.nullcontext())
    ctx = ChunkedOffload(chunk_bytes=1)
    assert all(torch.equal(a, b) for a, b in zip(plain, run(False, ctx)))
    # 16 KiB each: x, the three products, q, k and q * k; v (saved last) stays
    assert ctx.offload_synchronizer.stats.bytes_offloaded == 7 * 64 * 64 * 4
    # and comes back once: each shared handle counts as one pop more (NOTE [Reloaded
    # tensors go one by one] in engine/layer_data.py)
    assert ctx.offload_synchronizer.stats.bytes_reloaded == 7 * 64 * 64 * 4
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(True, contextlib.nullcontext())
    ctx = ChunkedOffload(chunk_bytes=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(True, ctx)
    assert ctx.offload_synchronizer.stats.bytes_offloaded == 8 * 64 * 64 * 4  # x twice


@pytest.mark.parametrize("order", ["tensor first", "view first"])
def test_a_storage_saved_in_two_chunks_through_two_views_is_copied_once(order):
    """``out`` saved in one chunk and ``out.t()`` in a later one (TRL's deduplication
    test has this shape): their one storage moves once (NOTE [A tensor saved in several
    chunks]); modified in place in between, it moves again and backward raises
    autograd's error, as without offload."""
    import contextlib

    def run(ctx, modify: bool = False) -> torch.Tensor:
        x = torch.randn(40, 50, generator=torch.Generator().manual_seed(0))
        x.requires_grad_()
        with ctx:
            out = (x * 1.0).sin()  # saves x * 1.0 (8,000 B): chunk 0
            first, second = (out, out.t()) if order == "tensor first" else (out.t(), out)
            a = first.cos()  # saves out's storage: chunk 1
            if modify:
                out.mul_(2)
            b = second.sin()  # the same storage again
            c = b.cos()  # saves b: the last chunk, which stays
            loss = a.sum() + c.sum()
        loss.backward()
        return x.grad

    plain = run(contextlib.nullcontext())
    ctx = ChunkedOffload(chunk_bytes=1)
    assert torch.equal(plain, run(ctx))
    assert ctx.offload_synchronizer.stats.bytes_offloaded == 2 * 8000  # not 3 * 8000
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(contextlib.nullcontext(), modify=True)
    ctx = ChunkedOffload(chunk_bytes=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(ctx, modify=True)
    assert ctx.offload_synchronizer.stats.bytes_offloaded == 3 * 8000  # changed: moved again


def test_counters_of_the_whole_forward_context_see_its_forwards():
    """get_offloaded_total_size_mb() and in_flight_passes() count the bytes on the host
    and the forwards whose graphs are alive, and go to zero with the graph."""
    gc.collect()
    gc.disable()
    try:
        model = make_model()
        ctx = ChunkedOffload(1, min_offload_numel=0)
        engine = ctx.offload_synchronizer
        assert engine.in_flight_passes() == [] and engine.get_offloaded_total_size_mb() == 0
        with ctx:
            first = model(torch.randn(16, 32, requires_grad=True)).sum()
        with ctx:
            second = model(torch.randn(16, 32, requires_grad=True)).sum()
        passes = engine.in_flight_passes()
        assert [p.index for p in passes] == [0, 1]
        on_host = engine.get_offloaded_total_size_mb()
        assert on_host * 2**20 == engine.stats.bytes_offloaded > 0
        assert passes[0].get_offloaded_total_size_mb() == on_host / 2
        del passes
        first.backward()
        assert [p.index for p in engine.in_flight_passes()] == [1]
        assert engine.get_offloaded_total_size_mb() == on_host / 2
        del second  # dropped without a backward
        assert engine.in_flight_passes() == [] and engine.get_offloaded_total_size_mb() == 0
        assert engine.host_memory_stats()["in_use_bytes"] == 0
    finally:
        gc.enable()


def test_a_large_last_chunk_moves_at_the_defaults():
    """One large tensor saved last (the logits a loss saves): with growing chunks it
    moves as the context is left, and backward's first pop brings it back."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    w = nn.Parameter(torch.randn(64, 4096), requires_grad=False)  # saved by @, stays
    plain = torch.autograd.grad((x.sin() @ w).exp().sum(), x)[0]
    for only_one in (True, False):
        ctx = OffloadActivations()
        with ctx:
            h = x if only_one else x.sin()  # sin saves x (16 KiB)
            loss = (h @ w).exp().sum()  # saves the 1 MiB output: the last chunk
        stats = ctx.offload_synchronizer.stats
        assert stats.bytes_offloaded == 64 * 4096 * 4 + (0 if only_one else 64 * 64 * 4)
        assert torch.equal(
            torch.autograd.grad(loss, x)[0],
            plain if not only_one else torch.autograd.grad((x @ w).exp().sum(), x)[0],
        )
        assert stats.bytes_reloaded == stats.bytes_offloaded and stats.on_demand_reloads == 0


def test_a_forward_that_moves_nothing_says_why_once():
    x = torch.randn(64, 64, requires_grad=True)
    ctx = OffloadActivations(min_offload_size=2**20)
    with pytest.warns(UserWarning, match="each is under min_offload_size=1048576") as caught:
        for _ in range(2):
            with ctx:
                loss = x.exp().sum()
            loss.backward()
    assert len(caught) == 1 and "OffloadActivations moved nothing" in str(caught[0].message)
    one_chunk = ChunkedOffload(chunk_bytes=2**20)
    with pytest.warns(UserWarning, match="fit in one chunk, the last"):
        with one_chunk:
            loss = x.exp().sum()
        loss.backward()


def test_update_model_params_keeps_parameters_and_buffers():
    """TRL's update_model_params: parameters and buffers (and their views) stay."""
    model = nn.Linear(64, 64)
    model.register_buffer("mask", torch.ones(64, 64))
    moved = []
    for update in (False, True):
        ctx = OffloadActivations(min_offload_size=0, chunk_bytes=1)
        if update:
            ctx.update_model_params(model)
            assert ctx.param_storages == {
                p.untyped_storage().data_ptr() for p in model.parameters()
            }
        x = torch.randn(64, 64, requires_grad=True)
        with ctx:
            loss = (model(x) * model.mask.t()).exp().sum()  # saves a view of the buffer
        loss.backward()
        moved.append(ctx.offload_synchronizer.stats.tensors_offloaded)
    # x moves, and the buffer's view (saved by the product) unless marked; exp's output
    # (the last chunk) stays
    assert moved == [2, 1]
