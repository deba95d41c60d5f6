"""Parity with autograd: every program computes, or fails, exactly as without offload.

Each row of ``PROGRAMS`` is a small program over ``L`` layers run three times per
parameter set: without offload (the baseline), then with offload (k = 1 and
k = L - 1, on the host path, under ``strict_streams()``, and through ``StreamBackend``
on the simulated CUDA and NPU runtimes of ``strict_runtime()``).  Gradients must be
``torch.equal``; where the baseline raises, the offloaded run raises the same
exception class (and, for autograd's in-place check, autograd's words).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import tiny_hf_model
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_sac

from cpu_offload import (
    create_selective_checkpoint_contexts,
    get_cpu_offload_context,
    offload_layers,
)
from cpu_offload.chunked import ChunkedOffload
from cpu_offload.integrations.torchtune import OffloadActivations

pytestmark = pytest.mark.usefixtures("streams")

L = 3


@dataclass
class Offload:
    """What a program gets: ``None`` fields for the baseline run."""

    k: int | None
    handles: list[Any]

    def context(self) -> tuple[Any, Any]:
        if self.k is None:
            return None, None
        ctx, sync_fn = get_cpu_offload_context(True, self.k, L, min_offload_numel=0)
        self.handles.append(ctx)
        return ctx, sync_fn

    def sliced(self, slice_bytes: int = 1, **options: Any) -> tuple[Any, Any]:
        """The context with offloaded layers reloaded in slices of ``slice_bytes`` (NOTE
        [Reloading a layer in slices]); the baseline gets none."""
        if self.k is None:
            return None, None
        ctx, sync_fn = get_cpu_offload_context(
            True, self.k, L, min_offload_numel=0, reload_slice_bytes=slice_bytes, **options
        )
        self.handles.append(ctx)
        return ctx, sync_fn

    def layers(self, modules: list[torch.nn.Module]) -> None:
        if self.k is not None:
            handle = offload_layers(modules, self.k, min_offload_numel=0)
            self.handles.append(handle.context)

    def policy(self, modules: list[torch.nn.Module], policy: list[str]) -> None:
        """``offload_layers(modules, policy=...)``; the baseline runs the plain modules."""
        if self.k is not None:
            handle = offload_layers(modules, policy=policy, min_offload_numel=0)
            self.handles.append(handle.context)

    def sac(self, policy: Any, allow: bool = False) -> Callable[[], Any]:
        """The ``context_fn`` of a selective checkpoint: ours when offloading; for the
        baseline torch's own, which recomputes ``*_CPU_OFFLOAD`` ops in eager (ours keeps
        its contract: NOTE [The contract of torch's function])."""
        make = create_selective_checkpoint_contexts if self.k is not None else torch_sac
        return functools.partial(make, policy, allow_cache_entry_mutation=allow)

    def budget(self, modules: list[torch.nn.Module]) -> None:
        """``offload_layers(modules, memory_budget=...)``: a measured step, then the
        policy chosen for :data:`BUDGETS` at this k; the baseline runs the plain modules."""
        if self.k is not None:
            budget, link = BUDGETS[self.k]
            handle = offload_layers(
                modules, memory_budget=f"{budget}B", min_offload_numel=0, copy_bandwidth=link
            )
            self.handles.append(handle.context)

    @property
    def tensors_offloaded(self) -> int:
        return sum(h.offload_synchronizer.stats.tensors_offloaded for h in self.handles)


def chain(fns: list[Callable], x: torch.Tensor, ctx: Any, sync_fn: Any) -> torch.Tensor:
    for fn in fns:
        with ctx if ctx is not None else contextlib.nullcontext():
            x = fn(x)
        x = sync_fn(x) if sync_fn is not None else x
    return x


def leaf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


# ------------------------------------------------------------------ programs
# Each returns the tensors to compare; ``moves`` says whether offload must copy.


def plain_chain(off: Offload) -> list[torch.Tensor]:
    x = leaf(8, 4)
    chain([torch.sin, torch.cos, torch.exp], x, *off.context()).sum().backward()
    return [x.grad]


def under_the_profiler(off: Offload) -> list[torch.Tensor]:
    """A step under torch.profiler: the offloader's copies and waits run in ranges."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        x = leaf(8, 4)
        chain([torch.sin, torch.cos, torch.exp], x, *off.context()).sum().backward()
    return [x.grad]


def inplace_after_save_inside_layer(off: Offload) -> list[torch.Tensor]:
    def layer(h: torch.Tensor) -> torch.Tensor:
        out = h.exp()  # saves its output
        return out.add_(1)

    x = leaf(8, 4)
    chain([torch.sin, layer, torch.cos], x, *off.context()).sum().backward()
    return [x.grad]


def inplace_between_layers_before_copy(off: Offload) -> list[torch.Tensor]:
    ctx, sync_fn = off.context()
    x = leaf(8, 4)
    h = x * 1.0
    saved = h
    for index, fn in enumerate([torch.sin, torch.cos, torch.exp]):
        with ctx if ctx is not None else contextlib.nullcontext():
            out = fn(h)
        h = sync_fn(out) if sync_fn is not None else out
        if index == 0:
            saved.mul_(2)  # saved by layer 0; its copy starts when layer 1 enters
    h.sum().backward()
    return [x.grad]


def inplace_after_copy(off: Offload) -> list[torch.Tensor]:
    ctx, sync_fn = off.context()
    x = leaf(8, 4)
    h = saved = x * 1.0
    for index, fn in enumerate([torch.sin, torch.cos, torch.exp]):
        with ctx if ctx is not None else contextlib.nullcontext():
            out = fn(h)
            if index == 2:
                saved.mul_(2)  # saved by layer 0 and copied out when layer 1 entered
        h = sync_fn(out) if sync_fn is not None else out
    h.sum().backward()
    return [x.grad]


def inplace_after_copy_then_dropped(off: Offload) -> list[torch.Tensor]:
    """Layer 1 modifies layer 0's saved output in place after its copy started, then
    drops it: only the layer's own alias of it is left to tell."""

    def modify_input(h: torch.Tensor) -> torch.Tensor:
        out = h * 3.0  # saves nothing of h
        h.add_(1)  # saved by layer 0 (exp saves its output), copied when layer 1 entered
        return out

    x = leaf(8, 4)
    chain([torch.exp, modify_input, torch.sin], x * 1.0, *off.context()).sum().backward()
    return [x.grad]


def inplace_through_a_detached_alias_then_dropped(off: Offload) -> list[torch.Tensor]:
    """A detached alias (same version counter) modifies a saved tensor after its layer
    was released, its own object gone."""
    ctx, sync_fn = off.context()
    x = leaf(8, 4)
    h = x * 1.0
    alias = None
    for index, fn in enumerate([torch.exp, torch.sin, torch.cos]):
        with ctx if ctx is not None else contextlib.nullcontext():
            out = fn(h)
        h = sync_fn(out) if sync_fn is not None else out
        if index == 0:
            alias = h.detach()  # layer 0's saved output, without its object
        del out
    alias.add_(1)
    h.sum().backward()
    return [x.grad]


def inplace_on_a_kept_tensor(off: Offload) -> list[torch.Tensor]:
    ctx, sync_fn = off.context()
    x = leaf(8, 4)
    small = (x * 1.0)[:, :1]  # a strided view: not dense, it stays on the device
    h = x * 1.0
    for fn in [torch.sin, lambda t: t * small, torch.exp]:
        with ctx if ctx is not None else contextlib.nullcontext():
            h = fn(h)
        h = sync_fn(h) if sync_fn is not None else h
    small.add_(1)
    h.sum().backward()
    return [x.grad]


def conj_view(off: Offload) -> list[torch.Tensor]:
    w, x = leaf(8, 4, dtype=torch.complex64), leaf(8, 4, dtype=torch.complex64)
    fns = [lambda z: z.sin().conj() * w, lambda z: z * 1.5, lambda z: z * 2]
    chain(fns, x, *off.context()).abs().sum().backward()
    return [w.grad, x.grad]


def real_and_imag_views(off: Offload) -> list[torch.Tensor]:
    x = leaf(8, 4, dtype=torch.complex64)
    fns = [lambda z: (z.sin().real * z.imag).exp(), lambda z: z * 1.5, lambda z: z * 2]
    chain(fns, x, *off.context()).abs().sum().backward()
    return [x.grad]


def view_of_a_detached_slice(off: Offload) -> list[torch.Tensor]:
    base = torch.randn(80)[16:].detach()  # storage offset 16, no _base of its own
    x = leaf(4, 16)
    fns = [lambda h: h * base.view(4, 16), lambda h: h * 1.5, torch.sin]
    chain(fns, x, *off.context()).sum().backward()
    return [x.grad]


def sparse_csr_operand(off: Offload) -> list[torch.Tensor]:
    sparse = (torch.eye(8) * 3).to_sparse_csr()
    x = leaf(8, 4)
    chain([lambda h: sparse @ h.sin(), torch.cos, torch.sin], x, *off.context()).sum().backward()
    return [x.grad]


def nested_jagged(off: Offload) -> list[torch.Tensor]:
    def layer(h: torch.Tensor) -> torch.Tensor:
        h = h.sin()
        nested = torch.nested.as_nested_tensor([h[:3], h[3:]], layout=torch.jagged)
        return (nested.sin() * 2).values()

    x = leaf(8, 4)
    chain([layer, torch.cos, torch.sin], x, *off.context()).sum().backward()
    return [x.grad]


def identity_layer(off: Offload) -> list[torch.Tensor]:
    x = leaf(8, 4)
    chain([torch.sin, lambda h: h, torch.exp], x, *off.context()).sum().backward()
    return [x.grad]


def graph_cut_before_last_layer(off: Offload) -> list[torch.Tensor]:
    ctx, sync_fn = off.context()
    x, w = leaf(8, 4), leaf(4)
    h = x
    for index, fn in enumerate([torch.sin, torch.cos, lambda t: (t * w).exp()]):
        if index == L - 1:
            h = h.detach().requires_grad_()
        with ctx if ctx is not None else contextlib.nullcontext():
            h = fn(h)
        h = sync_fn(h) if sync_fn is not None else h
    h.sum().backward()
    return [w.grad]


def retain_graph_twice(off: Offload) -> list[torch.Tensor]:
    x = leaf(8, 4)
    loss = chain([torch.sin, torch.cos, torch.exp], x, *off.context()).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    return [first, x.grad]


class _UnpackedTwice(torch.autograd.Function):
    """``x * y``, whose backward unpacks its saved tensors twice: the first results
    dropped before the second unpack (``drop``), or held through it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, drop: bool) -> torch.Tensor:
        ctx.save_for_backward(x, y)
        ctx.drop = drop
        return x * y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, y = ctx.saved_tensors
        grad_x = grad * y
        if ctx.drop:
            del x, y
        x2, y2 = ctx.saved_tensors
        return grad_x, grad * x2, None


def unpacked_twice_in_one_node(drop: bool) -> Callable[[Offload], list[torch.Tensor]]:
    """A node that unpacks each saved tensor twice: the second unpack gets what the
    first did, or (``drop``: nothing holds the first any more) a copy from the host."""

    def program(off: Offload) -> list[torch.Tensor]:
        x = leaf(8, 4)
        layer = lambda h: _UnpackedTwice.apply(h.sin(), h.cos(), drop).exp()  # noqa: E731
        chain([layer, layer, layer], x, *off.context()).sum().backward()
        return [x.grad]

    return program


class _UnpackedInPackOrder(torch.autograd.Function):
    """``sin(a) * b * c`` saving ``a``, ``b`` and ``c``: its backward unpacks them in the
    order they were saved, the opposite of a reload in slices (the first tensor saved
    is in the last slice)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, c)
        return a.sin() * b * c

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        a, b, c = ctx.saved_tensors
        return grad * a.cos() * b * c, grad * a.sin() * c, grad * a.sin() * b


def sliced_layer(h: torch.Tensor) -> torch.Tensor:
    """Several saved tensors, a view moved through its base, one unpacked out of order."""
    gate, up = (h * 2).chunk(2, dim=-1)
    mixed = torch.nn.functional.silu(gate) * up
    return _UnpackedInPackOrder.apply(mixed.exp(), mixed.cos(), mixed.tanh()).repeat(1, 2)


def reloaded_in_slices(retain: bool, **options: Any) -> Callable[[Offload], list]:
    """Offloaded layers reloaded in slices of one tensor each: every slice prefetched
    one ahead, a tensor unpacked out of order (its slice issued at once); ``retain``:
    ``retain_graph=True`` and a second backward (the layers reloaded again)."""

    def program(off: Offload) -> list[torch.Tensor]:
        x = leaf(64, 8)  # 2 KiB per saved tensor
        loss = chain([sliced_layer] * L, x, *off.sliced(1, **options)).sum()
        loss.backward(retain_graph=retain)
        grads = [x.grad.clone()]
        if retain:
            loss.backward()
            grads.append(x.grad)
        return grads

    return program


def unpacked_twice_in_slices(drop: bool) -> Callable[[Offload], list[torch.Tensor]]:
    """:func:`unpacked_twice_in_one_node` with the layers reloaded in slices."""

    def program(off: Offload) -> list[torch.Tensor]:
        x = leaf(8, 4)
        layer = lambda h: _UnpackedTwice.apply(h.sin(), h.cos(), drop).exp()  # noqa: E731
        chain([layer, layer, layer], x, *off.sliced(64)).sum().backward()
        return [x.grad]

    return program


class _FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises (a failure in the middle of a backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError("failed in backward (simulated)")


def sliced_backward_that_raises_then_a_step(off: Offload) -> list[torch.Tensor]:
    """A backward that raises in the middle layer after the last layer's slices came
    back (the next layer's first slice issued), its graph dropped, then a step: the
    host buffers of the failed step are all given back."""
    ctx, sync_fn = off.sliced(1)
    for failing in (True, False):
        x = leaf(64, 8)
        middle = (lambda h: _FailsInBackward.apply(sliced_layer(h))) if failing else sliced_layer
        try:
            chain([sliced_layer, middle, sliced_layer], x, ctx, sync_fn).sum().backward()
        except RuntimeError:
            continue
    if ctx is not None:
        assert ctx.offload_synchronizer.host_memory_stats()["in_use_bytes"] == 0
    return [x.grad]


def sliced_partial_grad_then_backward(off: Offload) -> list[torch.Tensor]:
    """:func:`partial_grad_then_backward` with the layers reloaded in slices: the layers
    above the middle are reloaded in slices twice, the one below once, its first slice
    issued by the first walk."""
    x = leaf(64, 8)
    ctx, sync_fn = off.sliced(1)
    mid = chain([sliced_layer, sliced_layer], x, ctx, sync_fn)
    loss = chain([sliced_layer], mid, ctx, sync_fn).sum()
    (grad_mid,) = torch.autograd.grad(loss, mid, retain_graph=True)
    loss.backward()
    return [grad_mid, x.grad]


def sliced_passes_moved_whole(order: str) -> Callable[[Offload], list]:
    """Passes moved whole (``keep_passes=1``) and brought back a layer at a time, each
    layer in slices, the backwards in ``order``."""

    def program(off: Offload) -> list[torch.Tensor]:
        ctx, sync_fn = off.sliced(1, keep_passes=1)
        inputs, outputs = {}, {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # out of order: reloaded on demand, said once
            for step in order.split():
                micro = int(step[1:])
                if step[0] == "F":
                    inputs[micro] = leaf(64, 8)
                    outputs[micro] = chain([sliced_layer] * L, inputs[micro], ctx, sync_fn)
                else:
                    outputs.pop(micro).sum().backward()
        if ctx is not None:
            assert ctx.offload_synchronizer.host_memory_stats()["in_use_bytes"] == 0
        return [inputs[micro].grad for micro in sorted(inputs)]

    return program


def evaluation_between_passes_kept_one(off: Offload) -> list[torch.Tensor]:
    """``keep_passes=1``: a training pass waits for its backward while a forward runs
    under ``torch.no_grad()`` (its output held), then a second training pass (moved whole),
    then both backwards (NOTE [A pass that saves nothing] in forward_pass.py)."""
    ctx = sync_fn = None
    if off.k is not None:
        ctx, sync_fn = get_cpu_offload_context(True, off.k, L, min_offload_numel=0, keep_passes=1)
        off.handles.append(ctx)
    fns = [torch.sin, torch.cos, torch.exp]
    first, second = leaf(8, 4), leaf(8, 4)
    out = chain(fns, first, ctx, sync_fn)
    with torch.no_grad():
        evaluated = chain(fns, leaf(8, 4), ctx, sync_fn)
    later = chain(fns, second, ctx, sync_fn)
    out.sum().backward()
    later.sum().backward()
    return [first.grad, second.grad, evaluated]


def two_threads_kept_one(off: Offload) -> list[torch.Tensor]:
    """``keep_passes=1``, one context in two threads, each F F B B, their steps
    alternating (A F0, B F0, A F1, B F1, A B0, B B0, A B1, B B1) by events (NOTE [A
    backward queue per thread] in pass_schedule.py)."""
    ctx = sync_fn = None
    if off.k is not None:
        ctx, sync_fn = get_cpu_offload_context(True, off.k, L, min_offload_numel=0, keep_passes=1)
        off.handles.append(ctx)
    fns = [torch.sin, torch.cos, torch.exp]
    done = [threading.Event() for _ in range(8)]
    inputs = [leaf(8, 4) for _ in range(4)]  # A's two, then B's two
    raised: list[BaseException] = []

    def thread(first: int) -> None:
        outputs = []
        try:
            for step in range(4):
                turn = first + 2 * step
                if turn and not done[turn - 1].wait(60):
                    raise TimeoutError("the other thread did not take its turn")
                if step < 2:
                    outputs.append(chain(fns, inputs[2 * first + step], ctx, sync_fn))
                else:
                    outputs[step - 2].sum().backward()
                done[turn].set()
        except BaseException as error:  # noqa: BLE001 - raised below, in the test's thread
            raised.append(error)
            for event in done:
                event.set()

    threads = [threading.Thread(target=thread, args=(first,)) for first in (0, 1)]
    for running in threads:
        running.start()
    for running in threads:
        running.join(60)
    if raised:
        raise raised[0]
    return [x.grad for x in inputs]


def partial_grad_then_backward(off: Offload) -> list[torch.Tensor]:
    """``autograd.grad`` down to a middle hidden state with ``retain_graph=True``, then the
    whole backward: the layers above are walked twice."""
    x = leaf(8, 4)
    ctx, sync_fn = off.context()
    mid = chain([torch.sin, torch.cos], x, ctx, sync_fn)
    loss = chain([torch.exp], mid, ctx, sync_fn).sum()
    (grad_mid,) = torch.autograd.grad(loss, mid, retain_graph=True)
    loss.backward()
    return [grad_mid, x.grad]


def backward_twice_without_retain(off: Offload) -> list[torch.Tensor]:
    x = leaf(8, 4)
    loss = chain([torch.sin, torch.cos, torch.exp], x, *off.context()).sum()
    loss.backward()
    loss.backward()
    return [x.grad]


def gradient_penalty(off: Offload) -> list[torch.Tensor]:
    x, w = leaf(8, 4), leaf(4)
    fns = [lambda h: (h * w).sin(), lambda h: h.cos() * w, torch.exp]
    loss = chain(fns, x, *off.context()).sum()
    (grad_w,) = torch.autograd.grad(loss, w, create_graph=True)
    (grad_w.square().sum() + loss).backward()
    return [x.grad, w.grad]


def torch_func_grad_then_a_step(off: Offload) -> list[torch.Tensor]:
    ctx, sync_fn = off.context()
    fns = [torch.sin, torch.cos, torch.exp]
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saved-tensor hooks are disabled here"
        grad = torch.func.grad(lambda t: chain(fns, t, ctx, sync_fn).sum())(x)
    y = x.clone().requires_grad_()
    chain(fns, y, ctx, sync_fn).sum().backward()
    return [grad, y.grad]


def interrupted_between_layers_then_a_step(off: Offload) -> list[torch.Tensor]:
    ctx, sync_fn = off.context()
    fns = [torch.sin, torch.cos, torch.exp]
    for interrupted in (True, False):
        x = leaf(8, 4)
        h = x
        try:
            for index, fn in enumerate(fns):
                with ctx if ctx is not None else contextlib.nullcontext():
                    h = fn(h)
                h = sync_fn(h) if sync_fn is not None else h
                if interrupted and index == 0:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            del h
            continue
        h.sum().backward()
    return [x.grad]


def checkpoint_around_offloaded_layers(reentrant: bool) -> Callable[[Offload], list]:
    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(L)]
        off.layers(blocks)  # hooks first, then checkpoint: they fire inside it
        x = leaf(8, 4)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        x.sum().backward()
        return [p.grad for block in blocks for p in block.parameters()]

    return program


class SavesAfterRunning(torch.autograd.Function):
    """A reentrant checkpoint as Megatron-Core's ``tensor_parallel.checkpoint`` writes it:
    the CPU RNG state kept, the layers run under no-grad, the inputs saved after them."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable, *args: torch.Tensor) -> torch.Tensor:
        ctx.run_function = run_function
        ctx.rng_state = torch.get_rng_state()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        state = torch.get_rng_state()
        torch.set_rng_state(ctx.rng_state)
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        torch.set_rng_state(state)
        torch.autograd.backward(outputs, grads)
        return (None, *(t.grad for t in inputs))


def through_reentrant_chunks(blocks: list, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` through ``blocks`` in two reentrant checkpoints (the first block, the rest):
    torch's (``kind == "torch"``) or one that saves after running its layers, as
    Megatron's does."""
    for chunk in (blocks[:1], blocks[1:]):
        run = functools.partial(functools.reduce, lambda h, block: block(h), chunk)
        if kind == "torch":
            x = checkpoint(run, x, use_reentrant=True)
        else:
            x = SavesAfterRunning.apply(run, x)
    return x


def hooks_inside_reentrant_chunks(kind: str) -> Callable[[Offload], list]:
    """Hooked layers inside reentrant checkpoints of chunks [0], [1, 2] (dropout in every
    layer): torch's, or one that saves after running its layers (Megatron's shape)."""

    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.GELU())
            for _ in range(L)
        ]
        off.layers(blocks)
        through_reentrant_chunks(blocks, leaf(8, 4), kind).sum().backward()
        return [p.grad for b in blocks for p in b.parameters()]

    return program


def offloaded_checkpointed_layers(reentrant: bool) -> Callable[[Offload], list]:
    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(L)]

        class Checkpointed(torch.nn.Module):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return checkpoint(self.inner, x, use_reentrant=reentrant)

        wrapped = [Checkpointed(block) for block in blocks]
        off.layers(wrapped)  # checkpoint first, then hooks: its input is saved inside ours
        x = leaf(8, 4)
        for module in wrapped:
            x = module(x)
        x.sum().backward()
        return [p.grad for block in blocks for p in block.parameters()]

    return program


def shared_module(off: Offload) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    off.layers([block] * L)
    for _ in range(2):
        x = leaf(8, 4)
        h = x
        for _ in range(L):
            h = block(h)
        h.sum().backward()
    return [x.grad, *block.parameters()]


def compiled_autograd(off: Offload) -> list[torch.Tensor]:
    x, w = leaf(8, 4), leaf(4)
    fns = [lambda h: (h * w).sin(), lambda h: h.cos() * w, torch.exp]
    loss = chain(fns, x, *off.context()).sum()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()
    return [x.grad, w.grad]


def compiled_layers_with_layer_hooks(off: Offload) -> list[torch.Tensor]:
    """offload_layers' hooks on layers compiled before and after they were installed."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()) for _ in range(L)]
    blocks[0].compile(backend="aot_eager")
    off.layers(blocks)
    for block in blocks[1:]:
        block.compile(backend="aot_eager")
    x = leaf(8, 4)
    h = x
    for block in blocks:
        h = block(h)
    h.sum().backward()
    return [x.grad, *(p.grad for block in blocks for p in block.parameters())]


class Block(torch.nn.Module):
    """A block of user code (dynamo does not compile torch.nn's own modules as a frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(h)) * h


class Stack(torch.nn.Module):
    """Layers in a ModuleDict (torchtitan's layout), run in order."""

    def __init__(self) -> None:
        super().__init__()
        blocks = [Block() for _ in range(L)]
        self.layers = torch.nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            h = block(h)
        return h


def compiled_fullgraph_blocks(
    style: str, order: str, compiled_backward: bool = False
) -> Callable[[Offload], list[torch.Tensor]]:
    """Each layer compiled with fullgraph=True (aot_eager), ``in place``
    (block.compile(), torchtitan's apply_compile) or ``wrapped`` (torch.compile(block)
    registered in its place), before or after offload_layers(model); two steps, the
    second optionally under compiled autograd."""

    def compile_blocks(stack: Stack) -> None:
        for name, block in list(stack.layers.items()):
            if style == "in place":
                block.compile(backend="aot_eager", fullgraph=True)
            else:
                stack.layers.register_module(
                    name, torch.compile(block, backend="aot_eager", fullgraph=True)
                )

    def program(off: Offload) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        stack = Stack()
        if order == "offload first":
            off.layers(stack)  # type: ignore[arg-type]
        compile_blocks(stack)
        if order == "compile first":
            off.layers(stack)  # type: ignore[arg-type]
        grads = []
        for step in range(2):
            x = leaf(8, 4)
            loss = stack(x).sum()
            if compiled_backward and step == 1:
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward()
            grads.append(x.grad)
        torch._dynamo.reset()
        return [*grads, *(p.grad for p in stack.parameters())]

    return program


def varying_lengths_and_dropped_forwards(off: Offload) -> list[torch.Tensor]:
    """Steps of changing lengths (host blocks reused as other layouts), a permuted
    saved tensor, and a forward whose graph is dropped between steps."""
    w = leaf(4, 4)
    fns = [lambda h: (h @ w).transpose(0, 1).sin(), lambda h: h.t().exp(), torch.tanh]
    ctx, sync_fn = off.context()
    grads = []
    for length in (16, 3, 40, 7):
        x = leaf(length, 4)
        chain(fns, x, ctx, sync_fn).square().sum().backward()
        grads.append(x.grad)
        chain(fns, leaf(length + 1, 4), ctx, sync_fn)  # dropped without backward
    return [*grads, w.grad]


def permuted_saved_tensors(off: Offload) -> list[torch.Tensor]:
    """Dense saved tensors with permuted strides, views and not (NPU copies them flat)."""
    x = leaf(8, 6)
    fns = [
        lambda h: (h.t() * 2).sin(),
        lambda h: h.reshape(2, 3, 8).permute(2, 0, 1).exp(),
        torch.tanh,
    ]
    chain(fns, x, *off.context()).sum().backward()
    return [x.grad]


def views_through_their_base(off: Offload) -> list[torch.Tensor]:
    """q, k, v of one fused output and SwiGLU halves: views moved through their base."""
    x, w3, w2 = leaf(8, 6), leaf(6, 18), leaf(6, 12)

    def attention_like(h: torch.Tensor) -> torch.Tensor:
        q, k, v = (h @ w3).chunk(3, dim=-1)
        return (q * k).sin() * v

    def swiglu(h: torch.Tensor) -> torch.Tensor:
        gate, up = (h @ w2).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    chain([attention_like, swiglu, torch.tanh], x, *off.context()).sum().backward()
    return [x.grad, w3.grad, w2.grad]


def view_through_its_base_modified_after_release(off: Offload) -> list[torch.Tensor]:
    """Layer 0 saves a 2-D view of a 3-D activation (a matmul's input), which moves
    through its base; after the layer's release, the base is modified in place.  The
    release drops the base's memory (the version keeper of a view holds no base), and
    the check still sees the change."""
    x, w = leaf(2, 4, 6), leaf(6, 6)
    kept: list[torch.Tensor] = []

    def first(h: torch.Tensor) -> torch.Tensor:
        base = h * 1.0
        kept.append(base)
        return base @ w  # saves base.view(8, 6)

    def last(h: torch.Tensor) -> torch.Tensor:
        kept[0].add_(1)  # layer 0 was released when this layer entered
        return h.tanh()

    chain([first, torch.sin, last], x, *off.context()).sum().backward()
    return [x.grad, w.grad]


def tensors_saved_twice(modify: bool) -> Callable[[Offload], list[torch.Tensor]]:
    """A leaf and an activation each saved by two ops of one layer (copied once, handed
    back twice), beside layers that save each tensor once; with ``modify``, the
    activation is modified in place after both saves."""

    def program(off: Offload) -> list[torch.Tensor]:
        x, w = leaf(8, 4), leaf(4, 4)

        def twice(h: torch.Tensor) -> torch.Tensor:
            a = h.sin()
            out = (h * x) + (h * x).exp() + a * a.cos() + (a @ w) * a
            if modify:
                a.mul_(2)
            return out

        chain([twice, torch.sin, twice], x, *off.context()).sum().backward()
        return [x.grad, w.grad]

    return program


def integer_indices_from_nonzero(off: Offload) -> list[torch.Tensor]:
    """Index tensors of nonzero ((N, 1), strides (1, N)) and argsort saved by gathers."""
    x = leaf(64)

    def gather_positive(h: torch.Tensor) -> torch.Tensor:
        index = (h > 0).nonzero()  # saved by index_select
        return h.index_select(0, index[:, 0]).sin().sum() * h

    def sort_gather(h: torch.Tensor) -> torch.Tensor:
        order = h.argsort()
        return h.gather(0, order).exp()

    chain([gather_positive, sort_gather, torch.tanh], x, *off.context()).sum().backward()
    return [x.grad]


def exception_inside_a_layer_then_a_step(off: Offload) -> list[torch.Tensor]:
    """offload_layers: a step that raises inside a layer after it saved tensors, then a
    step; the failed step's graph is dropped."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(L)]
    off.layers(blocks)

    def fail(module: Any, args: Any, output: Any) -> None:
        raise RuntimeError("out of memory (simulated)")

    for failing in (True, False):
        hook = blocks[1][1].register_forward_hook(fail) if failing else None
        x = leaf(8, 4)
        h = x
        try:
            for block in blocks:
                h = block(h)
        except RuntimeError:
            del h
            continue
        finally:
            if hook is not None:
                hook.remove()
        h.sum().backward()
    return [x.grad, *(p.grad for block in blocks for p in block.parameters())]


def host_memory_cap_below_the_need(off: Offload) -> list[torch.Tensor]:
    """max_host_bytes holds one 4 KiB block: the rest stays on the device, exactly."""
    ctx = sync_fn = None
    if off.k is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the cap's warning
            ctx, sync_fn = get_cpu_offload_context(
                True, off.k, L, min_offload_numel=0, max_host_bytes="4KiB"
            )
        off.handles.append(ctx)
    x = leaf(32, 16)  # 2 KiB per saved tensor: one fits in the cap's block, then none
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = lambda h: h.sin().cos().exp()  # noqa: E731 - saves four 2 KiB tensors
        chain([layer, layer, torch.exp], x, ctx, sync_fn).sum().backward()
    if off.k is not None:
        stats = ctx.offload_synchronizer.stats
        assert stats.tensors_kept_by_host_cap > 0
        assert ctx.offload_synchronizer.host_memory_stats()["reserved_bytes"] <= 4096
    return [x.grad]


def byte_threshold(off: Offload) -> list[torch.Tensor]:
    """min_offload_bytes: fp64 tensors move, fp16 tensors of as many elements stay."""
    ctx = sync_fn = None
    if off.k is not None:
        ctx, sync_fn = get_cpu_offload_context(
            True, off.k, L, min_offload_numel=0, min_offload_bytes=256
        )
        off.handles.append(ctx)
    wide, narrow = leaf(4, 8, dtype=torch.float64), leaf(4, 8, dtype=torch.float16)
    fns = [torch.sin, torch.cos, torch.exp]
    chain(fns, wide, ctx, sync_fn).sum().backward()  # 32 x 8 bytes: moves
    moved = off.tensors_offloaded
    chain(fns, narrow, ctx, sync_fn).sum().backward()  # 32 x 2 bytes: stays
    assert off.tensors_offloaded == moved
    return [wide.grad, narrow.grad]


def whole_forward_inplace_then_dropped(chunk_bytes: int) -> Callable[[Offload], list]:
    """A whole forward: a saved tensor modified in place, then dropped, in a chunk that
    was copied and released (``chunk_bytes=1``) or in the last chunk, which stays."""

    def program(off: Offload) -> list[torch.Tensor]:
        ctx: Any = contextlib.nullcontext()
        if off.k is not None:
            ctx = ChunkedOffload(chunk_bytes=chunk_bytes)
            off.handles.append(ctx)
        x = leaf(16, 32)
        with ctx:
            a = x * 2
            b = a.sin()  # saves a
            c = b.cos()  # saves b: a's chunk closes and its copy starts
            a.add_(1)
            del a
            d = c.exp()  # saves its output: a's chunk is released
        d.sum().backward()
        return [x.grad]

    return program


def whole_forward_in_chunks(inplace: bool) -> Callable[[Offload], list]:
    """OffloadActivations around a whole forward (no layers), a chunk per tensor."""

    def program(off: Offload) -> list[torch.Tensor]:
        ctx: Any = contextlib.nullcontext()
        if off.k is not None:
            ctx = OffloadActivations(min_offload_size=0, chunk_bytes=1)
            off.handles.append(ctx)
        x, w = leaf(8, 4), leaf(4)
        with ctx:
            h = (x * w).sin()
            saved = h.cos()  # saved by sin, in a chunk of its own
            out = (saved.sin() * w).tanh()
            if inplace:
                saved.mul_(2)
        out.sum().backward()
        return [x.grad, w.grad]

    return program


def whole_forward_at_defaults(off: Offload) -> list[torch.Tensor]:
    """OffloadActivations() as TRL's users write it: 2 KiB tensors (over its 1 KiB
    min_offload_size), one of them saved by three ops in three chunks."""
    ctx: Any = contextlib.nullcontext()
    if off.k is not None:
        ctx = OffloadActivations()
        off.handles.append(ctx)
    x, wq, wk, wv = leaf(32, 16), leaf(16, 16), leaf(16, 16), leaf(16, 16)
    with ctx:
        h = (x * 2).sin()
        q = (h @ wq).tanh()  # h, then the product
        k = (h @ wk).tanh()  # h again
        v = (h @ wv).tanh()
        out = (q * k + v).exp()
    out.sum().backward()
    return [x.grad, wq.grad, wk.grad, wv.grad]


def whole_forward_views_in_two_chunks(modify: bool) -> Callable[[Offload], list]:
    """OffloadActivations: ``out`` saved in one chunk, ``out.t()`` in a later one (their
    storage moves once); optionally ``out`` changed in place between the two saves."""

    def program(off: Offload) -> list[torch.Tensor]:
        ctx: Any = contextlib.nullcontext()
        if off.k is not None:
            ctx = OffloadActivations(min_offload_size=0, chunk_bytes=1)
            off.handles.append(ctx)
        x, w = leaf(8, 6), leaf(6)
        with ctx:
            out = (x * w).sin()
            a = out.cos()  # saves out
            if modify:
                out.mul_(2)
            b = out.t().sin()  # saves out.t(), in a later chunk
            c = (b.cos() * 2).exp()  # later chunks: out.t()'s closes
        (a.sum() + c.sum()).backward()
        return [x.grad, w.grad]

    return program


#: a policy with every choice for each k the rows run at (k layers offloaded); layer 1
#: is checkpointed and offloaded in both
POLICIES = {
    1: ["keep", "checkpoint+offload", "checkpoint"],
    2: ["offload", "checkpoint+offload", "checkpoint"],
}


def per_layer_policy(inplace: bool) -> Callable[[Offload], list]:
    """offload_layers(policy=...): checkpointed layers with dropout (recomputed with the
    same masks), offloaded checkpoint inputs; optionally a checkpointed layer's input
    modified in place after the forward."""

    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh())
            for _ in range(L)
        ]
        off.policy(blocks, POLICIES[off.k or 1])
        x = leaf(8, 4)
        h, inputs = x * 1, []
        for block in blocks:
            inputs.append(h)
            h = block(h)
        if inplace:
            inputs[1].mul_(2)  # layer 1's input, saved by its checkpoint
        h.sum().backward()
        return [x.grad, *(p.grad for block in blocks for p in block.parameters())]

    return program


#: the memory budget and copy bandwidth of the automatic rows per k: a budget that keeps a
#: layer (the link measured), and one nothing fits on a link so slow that the closest
#: policy recomputes
BUDGETS: dict[int, tuple[int, float | None]] = {1: (700, None), 2: (1, 1e3)}


def automatic_policy(
    lengths: tuple[int, ...],
    inplace: bool = False,
    frozen_first: bool = False,
    skipped_first: int | None = None,
    failed_first: bool = False,
) -> Callable[[Offload], list]:
    """offload_layers(memory_budget=...): a measured step, then steps under the policy
    chosen from it (dropout in checkpointed layers, recomputed with the same masks); a
    longer input measured again and planned for; optionally a layer's input modified in
    place after the last forward, layer 0 run under no_grad in every step
    (``frozen_first``), a layer skipped in the first step (``skipped_first``: LayerDrop),
    a first step that raises in layer 1 (``failed_first``)."""

    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh())
            for _ in range(L)
        ]
        off.budget(blocks)
        found = []
        if failed_first:
            h = leaf(8, 4)
            try:
                h = blocks[1](blocks[0](h)[:, :3])  # 3 columns into Linear(4, 4): raises
            except RuntimeError as error:
                found.append(torch.tensor(float("mat1 and mat2" in str(error))))
        for step, rows in enumerate(lengths):
            x = leaf(rows, 4)
            h, inputs = x * 1, []
            for index, block in enumerate(blocks):
                inputs.append(h)
                if step == 0 and index == skipped_first:
                    continue
                with torch.no_grad() if frozen_first and index == 0 else contextlib.nullcontext():
                    h = block(h)
            if frozen_first:
                x.grad = torch.zeros_like(x)  # nothing flows back to x
            if inplace and step == len(lengths) - 1:
                inputs[1].mul_(2)  # layer 1's input, saved by its first operation or checkpoint
            h.sum().backward()
            grads = [p.grad for block in blocks for p in block.parameters()]
            found += [x.grad, *(torch.zeros(1) if g is None else g.clone() for g in grads)]
            for block in blocks:
                block.zero_grad(set_to_none=True)
        return found

    return program


def budget_with_the_models_checkpointing(off: Offload) -> list[torch.Tensor]:
    """``memory_budget=`` on a tiny Llama with transformers' gradient checkpointing
    (attention dropout: RNG in every recompute): a measured step, whose checkpoints'
    recomputes are measured, then two planned steps (NOTE [A checkpoint the model placed]
    in policy/model_checkpoints.py)."""
    model = tiny_hf_model("Llama", L, attention_dropout=0.25)
    model.gradient_checkpointing_enable()
    model.train()
    off.budget(list(model.model.layers))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache, and budgets nothing fits
        for step in range(3):
            torch.manual_seed(step)
            model(input_ids=ids, labels=ids).loss.backward()
            found += [p.grad.clone() for p in model.parameters() if p.grad is not None]
            model.zero_grad(set_to_none=True)
    return found


def budget_inside_reentrant_chunks(kind: str) -> Callable[[Offload], list]:
    """``memory_budget=`` with hooked layers inside reentrant checkpoints of chunks [0],
    [1, 2] (dropout in every layer): torch's, or Megatron's shape; a measured step, whose
    checkpoints' inputs and recomputes are counted, then two planned steps (NOTE [A
    budget around reentrant checkpoints] in policy/reentrant_budget.py)."""

    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.GELU())
            for _ in range(L)
        ]
        off.budget(blocks)
        found = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # budgets nothing fits
            for _ in range(3):
                through_reentrant_chunks(blocks, leaf(8, 4), kind).sum().backward()
                found += [p.grad.clone() for b in blocks for p in b.parameters()]
                for block in blocks:
                    block.zero_grad(set_to_none=True)
        return found

    return program


def budget_under_a_host_cap(off: Offload) -> list[torch.Tensor]:
    """offload_layers(memory_budget=..., max_host_bytes=...): the plan checkpoints where
    the host is short, and the steps move what it predicts, nothing refused by the cap."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(L)]
    handle = None
    if off.k is not None:
        handle = offload_layers(
            blocks,
            memory_budget="1B",
            max_host_bytes="100KiB",
            min_offload_numel=0,
            copy_bandwidth=1e3,
        )
        off.handles.append(handle.context)
    found = []
    for step in range(3):
        x = leaf(256, 64)  # 64 KiB per saved tensor: one fits the cap
        h = x
        for block in blocks:
            h = block(h)
        h.sum().backward()
        found += [x.grad, *(p.grad.clone() for block in blocks for p in block.parameters())]
        for block in blocks:
            block.zero_grad(set_to_none=True)
        if handle is not None and step > 0:
            report = handle.report().to_dict()
            assert report["moved_bytes"] == handle.plan.predicted.offloaded_bytes > 0
            assert "kept_bytes/host_cap" not in report
    return found


def a_host_that_refuses(off: Offload) -> list[torch.Tensor]:
    """The host refuses the second host allocation (out of memory, RLIMIT_MEMLOCK): what
    gets no buffer stays on the device, and the steps compute what they compute without."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(L)]
    ctx, sync_fn = off.context()
    if ctx is not None:
        backend, given = ctx.offload_synchronizer.backend, []
        allocate = backend.empty_host_bytes

        def refusing(nbytes: int) -> torch.Tensor:
            given.append(nbytes)
            if len(given) > 1:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
            return allocate(nbytes)

        backend.empty_host_bytes = refusing
    found = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cpu_offload: the host refused")
        for _ in range(2):
            x = leaf(32, 64)
            h = x
            for block in blocks:
                if ctx is None:
                    h = block(h)
                else:
                    with ctx:
                        h = block(h)
                    h = sync_fn(h)
            h.sum().backward()
            found += [x.grad, *(p.grad.clone() for block in blocks for p in block.parameters())]
            for block in blocks:
                block.zero_grad(set_to_none=True)
    if ctx is not None:
        assert ctx.offload_synchronizer.stats.host_allocations_failed == 1
    return found


class Keywords(torch.nn.Module):
    """A layer whose keyword arguments are named like ``torch.utils.checkpoint``'s own;
    each changes what it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        *,
        debug: bool = False,
        preserve_rng_state: bool = True,
        determinism_check: str = "default",
        early_stop: bool = True,
        use_reentrant: float = 1.0,
        function: float = 1.0,
        context_fn: float = 1.0,
    ) -> torch.Tensor:
        h = self.linear(x) * use_reentrant * function * context_fn
        h = h * 2 if debug else h
        h = h if preserve_rng_state else h + 1
        h = h - 0.5 if determinism_check == "none" else h
        return torch.tanh(h if early_stop else h * 3)


#: values the layer reads, and checkpoint would take for itself (accepting the first four)
KEYWORDS = {
    "debug": True,
    "preserve_rng_state": False,
    "determinism_check": "none",
    "early_stop": False,
    "use_reentrant": 0.5,
    "function": 1.5,
    "context_fn": 0.25,
}


def layer_keywords_named_like_checkpoints(names: tuple[str, ...]) -> Callable[[Offload], list]:
    """offload_layers(policy=...) on layers called with keyword arguments that
    ``torch.utils.checkpoint`` also takes: every one reaches the layer."""

    def program(off: Offload) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [Keywords() for _ in range(L)]
        off.policy(blocks, POLICIES[off.k or 1])
        x = leaf(8, 4)
        h = x
        for block in blocks:
            h = block(h, **{name: KEYWORDS[name] for name in names})
        h.sum().backward()
        return [x.grad, *(p.grad for block in blocks for p in block.parameters())]

    return program


class CachedLayer(torch.nn.Module):
    """Appends its keys and values to a cache it is given, as a Hugging Face decoder
    layer does, and attends over the cache under a mask of the input's length."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.key, self.value = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        past_key_values: dict[int, Any] | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        k, v = self.key(x), self.value(x)
        if past_key_values is not None:
            if self.index in past_key_values:
                old_k, old_v = past_key_values[self.index]
                k, v = torch.cat([old_k, k]), torch.cat([old_v, v])
            past_key_values[self.index] = (k, v)
        return torch.tanh(((x @ k.T + mask).softmax(-1) @ v) + x)


def layers_with_a_cache(off: Offload) -> list[torch.Tensor]:
    """offload_layers(policy=...) on layers given a cache (positionally, as GPT-2 does)
    and use_cache=True: a checkpointed layer's recompute does not append to it again."""
    torch.manual_seed(0)
    blocks = [CachedLayer(index) for index in range(L)]
    off.policy(blocks, POLICIES[off.k or 1])
    x = leaf(8, 4)
    mask = torch.full((8, 8), -1e4).triu(1)
    cache: dict[int, Any] = {}
    h = x
    for block in blocks:
        h = block(h, mask, cache, use_cache=True)
    h.sum().backward()
    return [x.grad, *(p.grad for block in blocks for p in block.parameters())]


# ------------------------------------------------- selective checkpointing (SAC)
# torch's policies per op, in layers that checkpoint with our context_fn (the baseline:
# torch's, *_CPU_OFFLOAD read as PREFER_SAVE; Offload.sac).

P = CheckpointPolicy
OFFLOAD_KINDS = (P.MUST_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD)
MUTATED = "Tensor cached during selective activation checkpoint has been mutated"
#: every kind of policy, one op each (dropout's ops, unlisted, are PREFER_RECOMPUTE)
EVERY_KIND = {
    torch.ops.aten.mm.default: P.MUST_CPU_OFFLOAD,
    torch.ops.aten.sin.default: P.PREFER_CPU_OFFLOAD,
    torch.ops.aten.tanh.default: P.MUST_SAVE,
    torch.ops.aten.cos.default: P.PREFER_SAVE,
    torch.ops.aten.exp.default: P.MUST_RECOMPUTE,
    torch.ops.aten.mul.Tensor: P.PREFER_RECOMPUTE,
}


def by_op(kinds: dict[Any, CheckpointPolicy]) -> Callable[..., CheckpointPolicy]:
    """A policy function: ``kinds`` per op, PREFER_RECOMPUTE for the others."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return kinds.get(op, P.PREFER_RECOMPUTE)

    return policy


def selective(body: Callable, context_fn: Callable) -> Callable:
    """A layer: ``body`` under non-reentrant checkpointing with ``context_fn``."""
    return lambda h: checkpoint(body, h, use_reentrant=False, context_fn=context_fn)


def sac_every_kind(off: Offload) -> list[torch.Tensor]:
    """Every policy kind in each layer, with dropout recomputed under the saved RNG state."""
    x, ws = leaf(8, 4), [leaf(4, 4) for _ in range(L)]

    def body(w: torch.Tensor) -> Callable:
        def layer(h: torch.Tensor) -> torch.Tensor:
            a = h @ w
            b = a.sin() * a.tanh()
            return torch.nn.functional.dropout(b.cos(), 0.5).exp()

        return layer

    fns = [selective(body(w), off.sac(by_op(EVERY_KIND))) for w in ws]
    chain(fns, x, *off.context()).sum().backward()
    return [x.grad, *(w.grad for w in ws)]


def sac_random_op_offloaded(off: Offload) -> list[torch.Tensor]:
    """An RNG op's output offloaded (not run again in the recompute) before dropout."""
    x = leaf(8, 4)
    policy = by_op({torch.ops.aten.randn.default: P.MUST_CPU_OFFLOAD})

    def layer(h: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(h.shape)
        return torch.nn.functional.dropout((h + noise).sin(), 0.5)

    chain([selective(layer, off.sac(policy))] * L, x, *off.context()).sum().backward()
    return [x.grad]


def sac_op_list(off: Offload) -> list[torch.Tensor]:
    """torch's shorthand, a list of ops to save: nothing is offloaded but the inputs."""
    x, w = leaf(8, 4), leaf(4, 4)
    ops = [torch.ops.aten.mm.default, torch.ops.aten.sin.default]
    layer = selective(lambda h: (h @ w).sin().cos(), off.sac(ops))
    chain([layer] * L, x, *off.context()).sum().backward()
    return [x.grad, w.grad]


def sac_two_outputs_and_a_view(off: Offload) -> list[torch.Tensor]:
    """Both outputs of var_mean, and a transposed view, offloaded."""
    x = leaf(8, 4)
    policy = by_op(
        {
            torch.ops.aten.var_mean.correction: P.MUST_CPU_OFFLOAD,
            torch.ops.aten.t.default: P.MUST_CPU_OFFLOAD,
        }
    )

    def layer(h: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(h, dim=0)
        return ((h - mean) * var).sin().t().exp().t()

    chain([selective(layer, off.sac(policy))] * L, x, *off.context()).sum().backward()
    return [x.grad]


def sac_in_place(where: str, allow: bool = False) -> Callable[[Offload], list]:
    """An in-place change: of an offloaded output inside its checkpoint (``inside``) or
    in the next layer, after its copy started (``after copy``); of a saved output
    (``saved``); of a checkpoint's input, saved by the layer (``input``)."""

    def program(off: Offload) -> list[torch.Tensor]:
        x, w = leaf(8, 4), leaf(4, 4)
        policy = by_op(
            {
                torch.ops.aten.mm.default: P.MUST_CPU_OFFLOAD,
                torch.ops.aten.tanh.default: P.MUST_SAVE,
            }
        )

        def first(h: torch.Tensor) -> torch.Tensor:
            a = h @ w
            if where == "inside":
                a.mul_(2)
            b = h.tanh()
            if where == "saved":
                b.mul_(2)
            return a if where == "after copy" else (a * b).sin()

        def second(h: torch.Tensor) -> torch.Tensor:
            if where == "after copy":
                h.mul_(2)  # layer 0's offloaded output, copied when this layer entered
            return h.cos()

        ctx, sync_fn = off.context()
        inputs = []
        h = x * 1.0
        for fn in [selective(first, off.sac(policy, allow)), second, torch.exp]:
            inputs.append(h)
            with ctx if ctx is not None else contextlib.nullcontext():
                h = fn(h)
            h = sync_fn(h) if sync_fn is not None else h
        if where == "input":
            inputs[0].add_(1)  # saved by layer 0's checkpoint
        h.sum().backward()
        return [x.grad, w.grad]

    return program


def sac_backward_twice(saved: bool) -> Callable[[Offload], list]:
    """retain_graph=True, then a second backward: torch's function allows it where the
    region saves nothing (its offloaded ops it recomputes), and raises where it saves
    an op's output (``saved``: tanh, MUST_SAVE)."""

    def program(off: Offload) -> list[torch.Tensor]:
        x, w = leaf(8, 4), leaf(4, 4)
        body = (lambda h: (h @ w).sin().tanh()) if saved else (lambda h: (h @ w).sin())
        layer = selective(body, off.sac(by_op(EVERY_KIND)))
        loss = chain([layer] * L, x, *off.context()).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad, w.grad]

    return program


def sac_gradient_penalty(off: Offload) -> list[torch.Tensor]:
    """create_graph=True through regions whose mm and sin outputs are offloaded: the
    penalty differentiates through them, as through torch's recomputed ones."""
    x, w = leaf(8, 4), leaf(4, 4)
    layer = selective(lambda h: (h @ w).sin().cos(), off.sac(by_op(EVERY_KIND)))
    loss = chain([layer] * L, x, *off.context()).sum()
    (g,) = torch.autograd.grad(loss, [x], create_graph=True)
    (g.square().sum() + loss).backward()
    return [x.grad, w.grad]


class SelectiveBlock(torch.nn.Module):
    """A block that checkpoints its own forward with a selective policy."""

    def __init__(self, context_fn: Callable) -> None:
        super().__init__()
        self.linear, self.context_fn = torch.nn.Linear(4, 4), context_fn
        self.dropout = torch.nn.Dropout(0.5)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.dropout(self.linear(x))).tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False, context_fn=self.context_fn)


def sac_in_offload_layers(off: Offload) -> list[torch.Tensor]:
    """offload_layers on blocks that checkpoint selectively inside their forward."""
    torch.manual_seed(0)
    policy = by_op(
        {
            torch.ops.aten.addmm.default: P.MUST_CPU_OFFLOAD,
            torch.ops.aten.gelu.default: P.PREFER_CPU_OFFLOAD,
        }
    )
    blocks = [SelectiveBlock(off.sac(policy)) for _ in range(L)]
    off.layers(blocks)
    x = leaf(8, 4)
    h = x
    for block in blocks:
        h = block(h)
    h.sum().backward()
    return [x.grad, *(p.grad for block in blocks for p in block.parameters())]


def sac_in_a_whole_forward(off: Offload) -> list[torch.Tensor]:
    """OffloadActivations around a whole forward whose checkpoints offload outputs."""
    ctx: Any = contextlib.nullcontext()
    if off.k is not None:
        ctx = OffloadActivations(min_offload_size=0, chunk_bytes=1)
        off.handles.append(ctx)
    x, w = leaf(8, 4), leaf(4, 4)
    layer = selective(lambda h: (h @ w).sin().cos(), off.sac(by_op(EVERY_KIND)))
    with ctx:
        out = layer(layer(x)).exp()
    out.sum().backward()
    return [x.grad, w.grad]


@dataclass
class Row:
    program: Callable[[Offload], list[torch.Tensor]]
    moves: bool = True  # offload must copy something (else the row proves nothing)
    match: str | None = None  # the error both runs raise, when they do
    #: torch.compile runs on the host path only: under the simulated streams' dispatch
    #: mode dynamo skips every frame (and fullgraph=True raises without offload too)
    compiled: bool = False


MODIFIED = "modified by an inplace operation"


#: modules= of the Hugging Face rows: Megatron's names, a path, the rest kept or not
MODULE_CHOICES: dict[str, Any] = {
    "llama": {"core_attn": "keep", "mlp.down_proj": "keep"},
    "llama, Megatron's list": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"],
    "mixtral": ["qkv_linear", "moe_act", "mlp.gate"],
    "mixtral, experts kept": {"mlp.experts": "keep", "rest": "offload"},
}


def graphed_steps(scope: bool | str, captured: bool) -> Callable[[Offload], list]:
    """``cuda_graph=scope``: a warm-up step, then a step whose forward and backward run
    while the backend says its stream is captured (the work still runs, so the captured
    schedule's gradients and stream ordering are checked); the baseline runs both plain."""

    def program(off: Offload) -> list[torch.Tensor]:
        ctx = sync_fn = None
        if off.k is not None:
            ctx, sync_fn = get_cpu_offload_context(
                True, off.k, L, min_offload_numel=0, cuda_graph=scope
            )
            off.handles.append(ctx)
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(L)]
        x = leaf(4, 8)
        for number in range(2):
            if ctx is not None:  # the second step is captured
                backend = ctx.offload_synchronizer.backend.wrapped
                backend.is_capturing = lambda: captured and number == 1  # noqa: B023
            chain(list(layers), x, ctx, sync_fn).sum().backward()
        if ctx is not None:
            del backend.is_capturing
            assert ctx.report().cuda_graph.captured == captured
        return [x.grad] + [p.grad for layer in layers for p in layer.parameters()]

    return program


def hugging_face_modules(kind: str, inplace: bool = False) -> Callable[[Offload], list]:
    """offload_layers(model, k, modules=...) on a tiny Hugging Face Llama (attention
    dropout: RNG) or Mixtral; optionally the attention's input (saved by its
    projections, kept or moved) modified in place after the forward."""

    def program(off: Offload) -> list[torch.Tensor]:
        if kind.startswith("llama"):
            model = tiny_hf_model("Llama", L, attention_dropout=0.25)
        else:
            model = tiny_hf_model("Mixtral", L)
        model.train()
        if off.k is not None:
            modules = MODULE_CHOICES[kind]
            handle = offload_layers(model, off.k, min_offload_numel=0, modules=modules)
            off.handles.append(handle.context)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        inputs: list[torch.Tensor] = []
        hook = model.model.layers[0].self_attn.register_forward_pre_hook(
            lambda module, args, kwargs: inputs.append(kwargs["hidden_states"]), with_kwargs=True
        )
        loss = model(input_ids=ids, labels=ids).loss
        hook.remove()
        if inplace:
            inputs[0].mul_(2)
        loss.backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    return program


PROGRAMS = {
    "plain chain": Row(plain_chain),
    "cuda_graph=True, eager steps (warm-up, no capture)": Row(graphed_steps(True, False)),
    "cuda_graph=True, a whole step captured": Row(graphed_steps(True, True)),
    "cuda_graph='layer', every layer's graphs captured": Row(graphed_steps("layer", True)),
    "a step under torch.profiler": Row(under_the_profiler),
    "in-place after save, inside the layer": Row(inplace_after_save_inside_layer, match=MODIFIED),
    "in-place between layers, before the copy": Row(
        inplace_between_layers_before_copy, match=MODIFIED
    ),
    "in-place after the copy": Row(inplace_after_copy, match=MODIFIED),
    "in-place after the copy, then dropped": Row(inplace_after_copy_then_dropped, match=MODIFIED),
    "in-place through a detached alias, then dropped": Row(
        inplace_through_a_detached_alias_then_dropped, match=MODIFIED
    ),
    "in-place on a kept tensor": Row(inplace_on_a_kept_tensor, match=MODIFIED),
    "conj view": Row(conj_view),
    "real and imag views": Row(real_and_imag_views),
    "view of a detached slice": Row(view_of_a_detached_slice),
    "sparse CSR operand": Row(sparse_csr_operand),
    "nested jagged tensor": Row(nested_jagged),
    "identity layer": Row(identity_layer),
    "graph cut before the last layer": Row(graph_cut_before_last_layer),
    "retain_graph, backward twice": Row(retain_graph_twice),
    "backward twice without retain_graph": Row(
        backward_twice_without_retain, match="backward through the graph a second time"
    ),
    "gradient penalty (create_graph)": Row(gradient_penalty),
    "a node unpacking its saved tensors twice": Row(unpacked_twice_in_one_node(False)),
    "a node unpacking twice, the first dropped": Row(unpacked_twice_in_one_node(True)),
    "autograd.grad to a middle layer (retain_graph), then backward": Row(
        partial_grad_then_backward
    ),
    "torch.func.grad, then a step": Row(torch_func_grad_then_a_step),
    "interrupted between layers, then a step": Row(interrupted_between_layers_then_a_step),
    "hooks inside non-reentrant checkpoint": Row(checkpoint_around_offloaded_layers(False), False),
    "hooks inside reentrant checkpoint": Row(checkpoint_around_offloaded_layers(True)),
    "hooks inside reentrant checkpoints of 1 and 2 layers, dropout": Row(
        hooks_inside_reentrant_chunks("torch")
    ),
    "hooks inside a checkpoint that saves after running (Megatron's)": Row(
        hooks_inside_reentrant_chunks("saves after")
    ),
    "non-reentrant checkpoint inside hooks": Row(offloaded_checkpointed_layers(False)),
    "reentrant checkpoint inside hooks": Row(offloaded_checkpointed_layers(True)),
    "one module at every position": Row(shared_module),
    "compiled autograd": Row(compiled_autograd),
    "offload_layers on compiled layers": Row(compiled_layers_with_layer_hooks),
    **{
        f"fullgraph blocks compiled {style}, {order}": Row(
            compiled_fullgraph_blocks(style, order), compiled=True
        )
        for style in ("in place", "wrapped")
        for order in ("offload first", "compile first")
    },
    "fullgraph blocks under compiled autograd": Row(
        compiled_fullgraph_blocks("in place", "offload first", compiled_backward=True),
        compiled=True,
    ),
    "varying lengths, dropped forwards": Row(varying_lengths_and_dropped_forwards),
    "permuted saved tensors": Row(permuted_saved_tensors),
    "views through their base (qkv, SwiGLU)": Row(views_through_their_base),
    "a view through its base, modified after the release": Row(
        view_through_its_base_modified_after_release, match=MODIFIED
    ),
    "integer indices from nonzero and argsort": Row(integer_indices_from_nonzero),
    "reloaded in slices, one unpacked out of order": Row(reloaded_in_slices(False)),
    "reloaded in slices, retain_graph=True twice": Row(reloaded_in_slices(True)),
    "reloaded in slices, layer 0 on demand (no prefetch)": Row(
        reloaded_in_slices(False, reload_on_demand_layers=[0])
    ),
    "reloaded in slices, every layer on demand, retain_graph=True twice": Row(
        reloaded_in_slices(True, reload_on_demand_layers=[0, 1, 2])
    ),
    "reloaded in slices under max_host_bytes": Row(
        reloaded_in_slices(False, max_host_bytes="4KiB")
    ),
    "reloaded in slices, unpacked twice, first dropped": Row(unpacked_twice_in_slices(True)),
    "reloaded in slices, unpacked twice, first held": Row(unpacked_twice_in_slices(False)),
    "reloaded in slices, a backward that raises, then a step": Row(
        sliced_backward_that_raises_then_a_step
    ),
    "reloaded in slices, autograd.grad then backward": Row(sliced_partial_grad_then_backward),
    "reloaded in slices, passes moved whole, GPipe": Row(
        sliced_passes_moved_whole("F0 F1 F2 F3 B0 B1 B2 B3")
    ),
    "reloaded in slices, passes moved whole, reverse": Row(
        sliced_passes_moved_whole("F0 F1 F2 F3 B3 B2 B1 B0")
    ),
    "memory_budget with the model's gradient checkpointing": Row(
        budget_with_the_models_checkpointing
    ),
    "memory_budget, hooks inside reentrant checkpoints of 1 and 2 layers": Row(
        budget_inside_reentrant_chunks("torch")
    ),
    "memory_budget, hooks inside checkpoints that save after running": Row(
        budget_inside_reentrant_chunks("saves after")
    ),
    "keep_passes=1, a no_grad forward between two passes": Row(evaluation_between_passes_kept_one),
    "keep_passes=1, two threads share the context, steps alternating": Row(two_threads_kept_one),
    "tensors saved twice (a leaf, an activation)": Row(tensors_saved_twice(False)),
    "a tensor saved twice, modified in place": Row(tensors_saved_twice(True), match=MODIFIED),
    "exception inside a layer, then a step": Row(exception_inside_a_layer_then_a_step),
    "max_host_bytes below the need": Row(host_memory_cap_below_the_need),
    "min_offload_bytes": Row(byte_threshold),
    "OffloadActivations around a whole forward": Row(whole_forward_in_chunks(False)),
    "OffloadActivations, in-place after save": Row(whole_forward_in_chunks(True), match=MODIFIED),
    "OffloadActivations at its defaults, a tensor in three chunks": Row(whole_forward_at_defaults),
    "OffloadActivations, a tensor and its transpose in two chunks": Row(
        whole_forward_views_in_two_chunks(False)
    ),
    "OffloadActivations, a tensor changed between two views' saves": Row(
        whole_forward_views_in_two_chunks(True), match=MODIFIED
    ),
    "whole forward, in-place then dropped, copied chunk": Row(
        whole_forward_inplace_then_dropped(1), match=MODIFIED
    ),
    "whole forward, in-place then dropped, last chunk": Row(
        whole_forward_inplace_then_dropped(2**40), moves=False, match=MODIFIED
    ),
    "policy: keep, offload, checkpoint, checkpoint+offload": Row(per_layer_policy(False)),
    "policy, a checkpoint's input modified in place": Row(per_layer_policy(True), match=MODIFIED),
    "policy, layer keywords checkpoint would take": Row(
        layer_keywords_named_like_checkpoints(
            ("debug", "preserve_rng_state", "determinism_check", "early_stop")
        )
    ),
    "policy, layer keywords checkpoint refuses": Row(
        layer_keywords_named_like_checkpoints(("use_reentrant", "function", "context_fn"))
    ),
    "policy, a layer given a cache and use_cache=True": Row(layers_with_a_cache),
    "SAC: every policy kind, dropout": Row(sac_every_kind),
    "SAC: an RNG op's output offloaded, dropout after it": Row(sac_random_op_offloaded),
    "SAC: a list of ops": Row(sac_op_list),
    "SAC: two outputs and a view offloaded": Row(sac_two_outputs_and_a_view),
    "SAC: offloaded output changed in place, inside": Row(sac_in_place("inside")),
    "SAC: offloaded output changed in place after its copy": Row(sac_in_place("after copy")),
    "SAC: saved output changed in place": Row(sac_in_place("saved"), match=MUTATED),
    "SAC: checkpoint input changed in place": Row(sac_in_place("input"), match=MODIFIED),
    "SAC: allow_cache_entry_mutation, changed inside": Row(sac_in_place("inside", allow=True)),
    "SAC: allow_cache_entry_mutation, changed after the copy": Row(
        sac_in_place("after copy", allow=True)
    ),
    "SAC: retain_graph=True, then a second backward": Row(sac_backward_twice(False)),
    "SAC: backward twice through a saved op": Row(
        sac_backward_twice(True), match="Trying to backward an extra time"
    ),
    "SAC: a gradient penalty (create_graph=True)": Row(sac_gradient_penalty),
    "SAC: offload_layers on blocks that checkpoint": Row(sac_in_offload_layers),
    "SAC: OffloadActivations around a whole forward": Row(sac_in_a_whole_forward),
    "memory_budget: measured, then planned": Row(automatic_policy((8, 8, 8))),
    **{
        f"modules= on Hugging Face {kind}": Row(hugging_face_modules(kind))
        for kind in MODULE_CHOICES
    },
    "modules=, a kept submodule's input modified in place": Row(
        hugging_face_modules("llama", inplace=True), match=MODIFIED
    ),
    "memory_budget under a host cap": Row(budget_under_a_host_cap),
    "a host that refuses an allocation": Row(a_host_that_refuses),
    "memory_budget, a longer input measured again": Row(automatic_policy((8, 8, 24, 24, 8))),
    "memory_budget, a layer's input modified in place": Row(
        automatic_policy((8, 8), inplace=True), match=MODIFIED
    ),
    "memory_budget, a frozen first layer under no_grad": Row(
        automatic_policy((8, 8, 8), frozen_first=True)
    ),
    "memory_budget, a layer skipped in the measured step": Row(
        automatic_policy((8, 8, 8, 8), skipped_first=1)
    ),
    "memory_budget, a measured step that raised": Row(
        automatic_policy((8, 8, 8), failed_first=True)
    ),
}


def outcome(program: Callable[[Offload], list], off: Offload) -> tuple[str, Any]:
    torch.manual_seed(0)
    try:
        return "ok", [t.detach().clone() for t in program(off)]
    except Exception as error:  # noqa: BLE001 - the class is what is compared
        return "raised", error


@pytest.mark.parametrize("k", [1, L - 1], ids=["k1", f"k{L - 1}"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_parity(name, k, quiet, streams):
    row = PROGRAMS[name]
    if row.compiled and streams is not None:
        pytest.skip("torch.compile runs on the host path only (Row.compiled)")
    expected = outcome(row.program, Offload(None, []))
    off = Offload(k, [])
    actual = outcome(row.program, off)
    if expected[0] == "raised":
        assert row.match is not None and row.match in str(expected[1]), expected[1]
        assert actual[0] == "raised", "the baseline raised, the offloaded run did not"
        assert type(actual[1]) is type(expected[1])
        assert row.match in str(actual[1]), actual[1]
    else:
        assert row.match is None, "the baseline was expected to raise"
        if actual[0] == "raised":
            raise actual[1]
        assert len(expected[1]) == len(actual[1])
        for a, b in zip(expected[1], actual[1]):
            assert a.dtype == b.dtype and torch.equal(a, b)
    if row.moves:
        assert off.tensors_offloaded > 0, "nothing was offloaded: the row proves nothing"


def test_in_place_error_names_the_layer():
    _, error = outcome(inplace_after_copy, Offload(1, []))
    assert isinstance(error, RuntimeError)
    assert "is at version 1; expected version 0 instead" in str(error)
    assert "saved by layer 0 of forward pass" in str(error)


class _Square(torch.nn.Module):
    """``lin(x) ** 2`` through a multiply that saves ``h = lin(x)``; keeps ``h``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.h: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = self.lin(x)
        return self.h * self.h


def test_a_data_change_after_the_copy_uses_the_copy_as_save_on_cpu():
    """Parity's documented limit (docs/usage.md): ``h.data.mul_(2)`` after ``h`` was
    saved bumps no version counter; without hooks backward reads the changed ``h``, with
    offload it reads the copy made before the change (as ``save_on_cpu`` does on a device)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Square(), _Square())
    x = torch.randn(8, 16)

    def grads(change: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(x).sum()
        if change:
            model[0].h.data.mul_(2)  # invisible to autograd's version counter
        out.backward()
        return [p.grad.clone() for p in model[0].parameters()]

    unchanged, changed = grads(False), grads(True)
    assert not all(torch.equal(a, b) for a, b in zip(unchanged, changed))
    handle = offload_layers(model, 1, min_offload_numel=0)
    offloaded = grads(True)
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    assert all(torch.equal(a, b) for a, b in zip(unchanged, offloaded))
    handle.remove()
