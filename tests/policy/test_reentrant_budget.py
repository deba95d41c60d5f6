"""A memory budget around layers inside reentrant checkpoints (NOTE [A budget around
reentrant checkpoints] in policy/reentrant_budget.py): the measured step counts the
checkpoints' inputs on each chunk's last layer and the chunk's recompute at its
backward; the plan fits, never checkpoints those layers again, and its predicted peak
is the modeled accelerator's."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from helpers import modeled_device
from torch.utils.checkpoint import checkpoint

from cpu_offload import offload_layers
from cpu_offload.plan.auto_policy import BY_THE_MODEL
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda

H = 256
MIB = 2**20


class Block(torch.nn.Module):
    """A block whose recompute (in backward) marks the modeled memory, less what is live
    then and not counted by the offloader (``not_counted()``)."""

    def __init__(self, marks: list, not_counted: Callable[[], list]) -> None:
        super().__init__()
        self.up = torch.nn.Linear(H, 4 * H, device="meta")
        self.down = torch.nn.Linear(4 * H, H, device="meta")
        self.marks = marks
        self.not_counted = not_counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.down(torch.nn.functional.gelu(self.up(x)))
        if torch._C._current_graph_task_id() != -1 and self.marks:  # the recompute
            self.marks.append(self.marks[0].mark("recompute", [out, *self.not_counted()]))
        return out


def run_chunks(blocks: list[Block], size: int, x: torch.Tensor, grads: list) -> torch.Tensor:
    """The blocks in reentrant checkpoints of ``size`` blocks; each chunk's output
    gradient is noted in ``grads``."""
    for start in range(0, len(blocks), size):
        chunk = blocks[start : start + size]

        def run(h: torch.Tensor, chunk: list[Block] = chunk) -> torch.Tensor:
            for block in chunk:
                h = block(h)
            return h

        x = checkpoint(run, x, use_reentrant=True)
        x.register_hook(grads.append)
    return x


def modeled_steps(size: int, budget: str, steps: int = 3):
    """Four blocks in chunks of ``size`` under ``memory_budget=budget`` on the modeled
    accelerator: the plan, the measured layers, and each step's peak of the memory
    counted as the offloader counts it (the last output and the gradients left out),
    marked at each chunk's end in forward and at each block's end in recompute."""
    marks: list = []
    grads: list = []
    params: list = []
    last: list = []

    def not_counted() -> list:
        return [*last, *grads, *(p.grad for p in params if p.grad is not None)]

    blocks = [Block(marks, not_counted) for _ in range(4)]
    params += [p for b in blocks for p in b.parameters()]
    x = torch.empty(4 * H, H, device="meta", requires_grad=True)
    peaks = []
    with timed_runtime(modeled_device()) as run, modeled_cuda(run.live):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan's line
            handle = offload_layers(blocks, memory_budget=budget, min_offload_numel=0)
            for _ in range(steps):
                counted = []
                h = x.clone()  # as an embedding makes it
                for start in range(0, 4, size):
                    h = run_chunks(blocks[start : start + size], size, h, grads)
                    counted.append(run.mark("forward", [h]).counted)
                loss = h.sum()
                seed = torch.ones_like(loss)  # the loss and its gradient: not counted
                marks[:], last[:] = [run], [h, loss, seed]
                loss.backward(seed)
                counted += [mark.counted for mark in marks[1:]]
                peaks.append(max(counted))
                marks.clear()
                grads.clear()
                del h, loss, seed
                last.clear()
                x.grad = None
                for p in params:
                    p.grad = None
        plan, measured = handle.plan, handle.auto.measured
        handle.remove()
    return plan, measured, peaks


@pytest.mark.parametrize(
    ("size", "budget", "offloaded"),
    [
        # chunks of 1: 4 inputs of 1 MiB; a recompute holds up's and gelu's outputs (8)
        (1, "64MiB", 0),
        (1, "11MiB", 1),
        (1, "10MiB", 2),
        # chunks of 2: 2 inputs; a recompute holds 8 + 1 (the second input) + 8
        (2, "64MiB", 0),
        (2, "18MiB", 1),
    ],
)
def test_the_predicted_peak_is_the_modeled_peak(size, budget, offloaded):
    plan, measured, peaks = modeled_steps(size, budget)
    last = [j for j in range(4) if (j + 1) % size == 0]  # the chunks' last layers
    recompute = 8 * MIB * size + MIB * (size - 1)
    assert [r.recompute_bytes for r in measured] == [recompute * (j in last) for j in range(4)]
    assert [r.saved_bytes for r in measured] == [MIB * (j in last) for j in range(4)]
    assert all(r.in_checkpoint for r in measured)
    assert plan.fits and not any(c.startswith("checkpoint") for c in plan.policy)
    # what moves is the inputs of the chunks whose last layer is offloaded
    assert plan.predicted.offloaded_bytes == offloaded * MIB
    inputs = len(last) * MIB
    if not offloaded:  # every input kept, and the last chunk's recompute
        assert plan.predicted.peak_bytes == inputs + recompute
    assert peaks[1] == peaks[2] == plan.predicted.peak_bytes
    assert peaks[0] == inputs + recompute  # the measured step keeps everything


def test_a_budget_never_checkpoints_them_again_and_says_why():
    plan, _, _ = modeled_steps(1, "1MiB")
    assert not plan.fits
    assert not any(c.startswith("checkpoint") for c in plan.policy)
    assert any(BY_THE_MODEL in why for why in plan.checkpoint_refused)


def cpu_blocks() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.1), torch.nn.Tanh())
        for _ in range(4)
    ]


def chunked_run(blocks: list[torch.nn.Module], size: int, x: torch.Tensor) -> torch.Tensor:
    for start in range(0, len(blocks), size):
        chunk = blocks[start : start + size]

        def run(h: torch.Tensor, chunk: list = chunk) -> torch.Tensor:
            for block in chunk:
                h = block(h)
            return h

        x = checkpoint(run, x, use_reentrant=True)
    return x


def gradients(size: int, budget: str | None, steps: int = 3):
    """Per step, the gradients of four blocks (dropout: the checkpoint's RNG state) in
    reentrant chunks of ``size``, under ``memory_budget=budget`` or without offload."""
    blocks = cpu_blocks()
    params = [p for b in blocks for p in b.parameters()]
    handle = None
    if budget is not None:
        handle = offload_layers(blocks, memory_budget=budget, min_offload_numel=0)
    found = []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(64, 32, requires_grad=True)
        chunked_run(blocks, size, x).square().sum().backward()
        found.append([x.grad, *(p.grad.clone() for p in params)])
        for p in params:
            p.grad = None
    return found, handle


@pytest.mark.parametrize("size", [1, 2])
def test_gradients_are_bit_identical_to_the_program_without_offload(streams, quiet, size):
    expected, _ = gradients(size, None)
    # each chunk's input is 8 KiB: a budget below the kept inputs and recompute offloads
    found, handle = gradients(size, "40KiB")
    plan = handle.plan
    stats = handle.offload_synchronizer.stats
    handle.remove()
    assert plan is not None and "offload" in plan.policy, plan.line()
    assert not any(c.startswith("checkpoint") for c in plan.policy)
    assert stats.bytes_offloaded > 0 and stats.bytes_offloaded == stats.bytes_reloaded
    assert stats.on_demand_reloads == 0
    for want, got in zip(expected, found):
        assert all(torch.equal(a, b) for a, b in zip(want, got))


class Unhooked(torch.autograd.Function):
    """A reentrant checkpoint whose backward recomputes without the layers' hooks (their
    ``forward`` called directly): the budget cannot count its recompute."""

    @staticmethod
    def forward(ctx, run_function, x):  # type: ignore[override]
        ctx.run_function = run_function
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = x
            for block in ctx.blocks:
                out = block.forward(out)
        torch.autograd.backward(out, grad)
        return None, x.grad


def test_a_recompute_without_the_layers_hooks_says_the_budget_cannot_count_it():
    blocks = cpu_blocks()[:2]

    def run(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = block(h)
        return h

    def forward(x: torch.Tensor) -> torch.Tensor:
        class Chunk(Unhooked):
            pass

        out = Chunk.apply(run, x)
        out.grad_fn.blocks = blocks
        return out

    handle = offload_layers(blocks, memory_budget="1MiB", min_offload_numel=0)
    x = torch.randn(64, 32, requires_grad=True)
    with pytest.warns(UserWarning, match=r"backward ran 0 hooked layers where its forward ran 2"):
        forward(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per handle; the plan counts the inputs
        forward(x).sum().backward()
    assert handle.plan is not None and handle.auto.measured[1].recompute_bytes == 0
    handle.remove()
