"""create_selective_checkpoint_contexts: torch's selective checkpointing whose *_CPU_OFFLOAD
outputs move with their layer: what moves (byte for byte) and when, where they stay
(outside an offloaded layer, allow_cache_entry_mutation), what it refuses, the memory it
gives back, and torch.compile.  Parity with autograd is in test_autograd_parity.py."""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_sac

import cpu_offload.policy.selective_checkpoint as selective_checkpoint
from cpu_offload import (
    CpuOffloadError,
    create_selective_checkpoint_contexts,
    get_cpu_offload_context,
    mark_not_offload,
)

P = CheckpointPolicy
L = 3
MM, SIN, SORT = torch.ops.aten.mm.default, torch.ops.aten.sin.default, torch.ops.aten.sort.default


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the warnings that are shown once."""
    monkeypatch.setattr(selective_checkpoint, "_warned", set())


class Recorder:
    """A policy that offloads ``kinds`` and records the bytes of their outputs, per layer."""

    def __init__(self, kinds: dict[Any, CheckpointPolicy]) -> None:
        self.kinds, self.layer, self.nbytes = kinds, 0, [0] * L
        self.storages: list[StorageWeakRef] = []

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        policy = self.kinds.get(op, P.PREFER_RECOMPUTE)
        if policy in (P.MUST_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD):
            outputs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
            self.nbytes[self.layer] += sum(t.nbytes for t in outputs)
            self.storages += [StorageWeakRef(t.untyped_storage()) for t in outputs]
        return policy


def body(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def layer(h: torch.Tensor) -> torch.Tensor:
        a = (h @ w).sin()
        values, indices = a.sort(dim=-1)  # a float32 and an int64 output
        return values * indices.to(a.dtype) + a

    return layer


def run_layers(
    policy: Any,
    ctx: Any,
    sync_fn: Any,
    create: Callable = create_selective_checkpoint_contexts,
    before_layer: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """L layers that checkpoint selectively, inputs kept on the device: only the outputs
    the policy offloads can move.  Returns the loss and the leaves."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(L)]
    h = x
    for index, w in enumerate(ws):
        if before_layer is not None:
            before_layer(index)
        if isinstance(policy, Recorder):
            policy.layer = index
        with ctx if ctx is not None else contextlib.nullcontext():
            mark_not_offload(h)
            h = checkpoint(
                body(w), h, use_reentrant=False, context_fn=functools.partial(create, policy)
            )
        h = sync_fn(h) if sync_fn is not None else h
    return h.sum(), [x, *ws]


@pytest.mark.parametrize("k", [1, L - 1])
def test_bytes_moved_are_the_offloaded_outputs_byte_for_byte(streams, quiet, k):
    policy = Recorder({MM: P.MUST_CPU_OFFLOAD, SORT: P.PREFER_CPU_OFFLOAD, SIN: P.MUST_SAVE})
    ctx, sync_fn = get_cpu_offload_context(True, k, L, min_offload_numel=0)
    loss, _ = run_layers(policy, ctx, sync_fn)
    stats = ctx.offload_synchronizer.stats
    expected = sum(policy.nbytes[:k])  # the last layers are not offloaded: theirs stay
    assert expected > 0 and policy.nbytes[k] > 0
    assert stats.bytes_offloaded == expected
    assert stats.tensors_offloaded == 3 * k  # mm's output, sort's values and indices
    loss.backward()
    assert stats.bytes_reloaded == expected
    assert stats.on_demand_reloads == 0  # prefetched by the schedule


def test_the_copy_starts_when_the_next_layer_starts_and_the_device_copy_goes_on_schedule(quiet):
    """k = 1 of 3: layer 0's outputs are copied as layer 1 enters (overlapping its
    compute) and their device memory is released as layer 2 enters."""
    ctx, sync_fn = get_cpu_offload_context(True, 1, L, min_offload_numel=0)
    stats, seen = ctx.offload_synchronizer.stats, []

    class Watching(Recorder):
        def __call__(self, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if self.layer == 1 and len(seen) == 2:  # layer 1's first op has run
                seen.append(("layer 1 computes", stats.bytes_offloaded))
            return super().__call__(*args, **kwargs)

    policy = Watching({MM: P.MUST_CPU_OFFLOAD})

    def before_layer(index: int) -> None:
        seen.append((index, stats.bytes_offloaded, [not r.expired() for r in policy.storages]))

    loss, _ = run_layers(policy, ctx, sync_fn, before_layer=before_layer)
    layer0 = policy.nbytes[0]
    assert seen == [
        (0, 0, []),
        (1, 0, [True]),  # layer 0's checkpoint is done, nothing copied yet
        ("layer 1 computes", layer0),  # layer 1 entered: the copy started
        (2, layer0, [True, True]),
    ]
    assert policy.storages[0].expired()  # layer 2 entered: layer 0 released
    loss.backward()


class OpCounter(TorchDispatchMode):
    """Counts the calls of one op that reach the dispatcher (a cached op does not)."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def sin_in_backward(loss: torch.Tensor) -> int:
    with OpCounter(SIN) as counter:
        loss.backward()
    return counter.count


def test_outside_an_offloaded_layer_outputs_are_saved_with_one_warning():
    policy = {SIN: P.MUST_CPU_OFFLOAD}
    with pytest.warns(UserWarning) as caught:
        loss, leaves = run_layers(functools.partial(by_op, policy), None, None)
    messages = [str(w.message) for w in caught if "cpu_offload" in str(w.message)]
    assert messages == [
        "cpu_offload.create_selective_checkpoint_contexts: aten.sin.default has policy "
        "MUST_CPU_OFFLOAD, but no offload context is active, so its output is saved on the "
        "device, as PREFER_SAVE would save it (and so are other such outputs there). Run the "
        "checkpoint inside a layer that offload_layers (or get_cpu_offload_context) "
        "offloads. This warning is shown once."
    ]
    (ours,) = [w for w in caught if "cpu_offload" in str(w.message)]
    assert ours.filename == __file__  # at the user's checkpoint call
    assert sin_in_backward(loss) == 0  # saved: not run again in the recompute
    grads = [t.grad for t in leaves]
    loss, leaves = run_layers(functools.partial(by_op, policy), None, None, create=torch_sac)
    assert sin_in_backward(loss) == L  # torch's own function recomputes it
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, leaves))


def by_op(kinds: dict[Any, CheckpointPolicy], ctx: Any, op: Any, *args: Any, **kwargs: Any):
    return kinds.get(op, P.PREFER_RECOMPUTE)


def test_a_layer_that_is_not_offloaded_saves_its_outputs_and_says_why(quiet):
    policy = Recorder({SIN: P.PREFER_CPU_OFFLOAD})
    ctx, sync_fn = get_cpu_offload_context(True, 1, L, min_offload_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = run_layers(policy, ctx, sync_fn)
    messages = [str(w.message) for w in caught if "create_selective" in str(w.message)]
    assert len(messages) == 1
    assert (
        "aten.sin.default has policy PREFER_CPU_OFFLOAD, but the checkpoint runs in a "
        in (messages[0])
    )
    assert "layer that is not offloaded (the last layer never is" in messages[0]
    assert ctx.offload_synchronizer.stats.bytes_offloaded == policy.nbytes[0]
    assert sin_in_backward(loss) == 0  # none recomputed, offloaded or not


def test_allow_cache_entry_mutation_keeps_offload_outputs_on_the_device(quiet):
    ctx, sync_fn = get_cpu_offload_context(True, 1, L, min_offload_numel=0)
    create = functools.partial(
        create_selective_checkpoint_contexts, allow_cache_entry_mutation=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = run_layers(Recorder({MM: P.MUST_CPU_OFFLOAD}), ctx, sync_fn, create=create)
    messages = [str(w.message) for w in caught if "create_selective" in str(w.message)]
    assert any("allow_cache_entry_mutation=True lets an output be changed" in m for m in messages)
    assert ctx.offload_synchronizer.stats.bytes_offloaded == 0
    loss.backward()


def test_the_graph_gives_its_host_memory_back_without_gc(quiet):
    """Dropped without backward, after backward, and with entries the recompute never
    reached (early stop: the last op's output is not needed again)."""
    kinds = {MM: P.MUST_CPU_OFFLOAD, torch.ops.aten.add.Tensor: P.MUST_CPU_OFFLOAD}
    ctx, sync_fn = get_cpu_offload_context(True, 2, L, min_offload_numel=0)
    synchronizer = ctx.offload_synchronizer
    gc.collect()
    gc.disable()
    try:
        loss, _ = run_layers(Recorder(kinds), ctx, sync_fn)
        assert synchronizer.host_memory_stats()["in_use_bytes"] > 0
        del loss
        assert synchronizer.host_memory_stats()["in_use_bytes"] == 0
        loss, _ = run_layers(Recorder(kinds), ctx, sync_fn)
        loss.backward()
        del loss
        assert synchronizer.host_memory_stats()["in_use_bytes"] == 0
    finally:
        gc.enable()


def test_torchs_errors_for_a_policy_it_does_not_take():
    with pytest.raises(ValueError, match="Expected op in `op_list` to be an OpOverload"):
        create_selective_checkpoint_contexts([2])
    with pytest.raises(ValueError, match="update the OpOverloadPacket to a specific OpOverload"):
        create_selective_checkpoint_contexts([torch.ops.aten.sin])
    with pytest.raises(TypeError, match="either a function or a list of ops"):
        create_selective_checkpoint_contexts(2)


def test_a_torch_that_caches_otherwise_is_refused_with_advice(monkeypatch):
    monkeypatch.setattr(selective_checkpoint, "LAYOUT_KNOWN", False)
    with pytest.raises(CpuOffloadError) as error:
        create_selective_checkpoint_contexts([MM])
    assert str(error.value).startswith(
        "cpu_offload.create_selective_checkpoint_contexts: torch "
    ) and "Use torch.utils.checkpoint.create_selective_checkpoint_contexts" in str(error.value)


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_under_torch_compile_it_is_torchs_function():
    """A traced checkpoint gets torch's own modes (nothing real to move): the compiled
    program computes what it computes with torch's function, without our warnings."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return {MM: P.MUST_CPU_OFFLOAD, SIN: P.MUST_SAVE}.get(op, P.PREFER_RECOMPUTE)

    grads = []
    for create in (torch_sac, create_selective_checkpoint_contexts):
        torch.manual_seed(0)
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        context_fn = functools.partial(create, policy)

        def f(x: torch.Tensor, w: torch.Tensor, context_fn: Any = context_fn) -> torch.Tensor:
            body = lambda t: (t @ w).sin().cos()  # noqa: E731
            return checkpoint(body, x, use_reentrant=False, context_fn=context_fn)

        torch._dynamo.reset()
        with recorded_warnings() as caught:
            torch.compile(f, backend="aot_eager", fullgraph=True)(x, w).sum().backward()
        assert not [w for w in caught if "cpu_offload" in str(w.message)]
        grads.append((x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
