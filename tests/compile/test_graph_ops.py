"""Copies as graph ops (issue 50 item 3, NOTE [Copies as graph ops]): an offloaded layer
compiled with ``fullgraph=True`` takes its saved intermediates through
``cpu_offload::offload_saved`` in its compiled forward and gives them back through
``cpu_offload::reload_saved`` in its compiled backward.  Each program is bit-identical,
with torch on one thread, to the same compiled program without offload."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from compiled_blocks import Decoder, compile_blocks, step
from helpers import MLPBlock, assert_bit_identical, modeled_device, offload_in_order
from torch._dynamo.testing import AotEagerAndRecordGraphs

from cpu_offload import offload_layers
from cpu_offload.hooks.graph_ops import graph_ops
from cpu_offload.testing import timed_runtime

K = 2  # of the decoder's 3 blocks
#: the option that asks for the graph ops (the default is the eager hooks)
GRAPH_OPS = {"compiled_copies": "graph_ops"}
#: the combinations of the compiled rows (tests/compile/test_compiled_layers.py)
AOT_EAGER = [
    (style, order)
    for style in ("in place", "wrapped")
    for order in ("offload first", "compile first")
]
INDUCTOR = [("in place", "offload first"), ("wrapped", "compile first")]


def run_both(style: str, order: str, backend: str, streams):
    """Two steps of the compiled program without offload, then with it (both under the
    ``streams`` flavour); their gradients, the handle and the tensors the ops took."""
    reference = Decoder("dict")
    model = copy.deepcopy(reference)
    compile_blocks(reference, style, backend)
    expected = [step(reference, seed) for seed in (1, 2)]
    packed, reloaded = graph_ops().packed, graph_ops().reloaded
    handle = offload_in_order(
        model, order, lambda m: compile_blocks(m, style, backend), K, **GRAPH_OPS
    )
    actual = [step(model, seed) for seed in (1, 2)]
    ops = graph_ops()
    return expected, actual, handle, (ops.packed - packed, ops.reloaded - reloaded)


def check(expected, actual, handle, ops) -> None:
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    stats = handle.offload_synchronizer.stats
    assert stats.tensors_offloaded > 0 and stats.bytes_offloaded > 0
    # Two saved intermediates per offloaded layer (the MLP's up projection and its
    # gelu) and step: each went through the ops, and only they moved (the layers'
    # inputs and weights are no donated buffers, NOTE [Copies as graph ops]).
    assert ops == (2 * K * 2, 2 * K * 2)
    assert stats.tensors_offloaded == 2 * K * 2
    handle.remove()


@pytest.mark.parametrize("style, order", AOT_EAGER)
def test_copies_as_graph_ops_aot_eager(style, order, streams):
    check(*run_both(style, order, "aot_eager", streams))


@pytest.mark.parametrize("style, order", INDUCTOR)
def test_copies_as_graph_ops_inductor(style, order, streams):
    """Inductor frees, reuses or writes in place into a saved tensor's buffer once the
    op has read it: the op hands the offloader a clone (without it, this differs)."""
    check(*run_both(style, order, "inductor", streams))


def test_the_ops_are_in_the_compiled_graphs_and_the_kept_layer_has_none():
    """The forward of an offloaded layer ends with the offload op, its backward starts
    with the reload op; the layer the schedule keeps (the last) runs the graph compiled
    without them, as does a step with offload turned off (a recompile, by dynamo's
    guard on the hooks: the keep-or-move choice is static per graph)."""
    backend = AotEagerAndRecordGraphs()
    model = Decoder("list")
    handle = offload_layers(model, K, min_offload_numel=0, **GRAPH_OPS)
    compile_blocks(model, "in place", backend)
    step(model, 1)
    forwards = [gm.code for gm in backend.fw_graphs]
    backwards = [gm.code for gm in backend.bw_graphs]
    assert len(forwards) == len(backwards) == 2  # moved (layers 0, 1) and kept (layer 2)
    assert sum("cpu_offload.offload_saved" in code for code in forwards) == 1
    assert sum("cpu_offload.reload_saved" in code for code in backwards) == 1
    handle.enabled = False
    packed = graph_ops().packed
    step(model, 2)
    assert graph_ops().packed == packed and len(backend.fw_graphs) == 2  # the kept graph
    handle.remove()


def test_a_second_backward_through_the_ops_reloads_again():
    """retain_graph=True: the tokens stay saved, and the second backward's reload op
    takes the layer's host copies again (aot_eager: inductor's donated buffers refuse a
    retained graph with and without offload alike)."""

    def run(offload: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = Decoder("list")
        handle = offload_layers(model, K, min_offload_numel=0, **GRAPH_OPS) if offload else None
        compile_blocks(model, "in place", "aot_eager")
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        loss = model(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        if handle is not None:
            handle.remove()
        return [p.grad for p in model.parameters()]

    expected = run(False)
    packed, reloaded = graph_ops().packed, graph_ops().reloaded
    assert_bit_identical(expected, run(True))
    assert (graph_ops().packed - packed, graph_ops().reloaded - reloaded) == (2 * K, 4 * K)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_batches_of_changing_sizes_through_the_ops(backend):
    """Dynamic shapes: once dynamo recompiles a layer with a symbolic batch, the sizes and
    strides the reload op takes are symbolic too (saved for backward as the graph's own
    symbols)."""

    def run(offload: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = Decoder("dict")
        handle = offload_layers(model, K, min_offload_numel=0, **GRAPH_OPS) if offload else None
        compile_blocks(model, "in place", backend)
        grads = []
        for rows in (8, 5, 11, 3):
            model.zero_grad(set_to_none=True)
            x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
            model(x).square().mean().backward()
            grads += [p.grad.clone() for p in model.parameters()]
        if handle is not None:
            handle.remove()
        return grads

    expected = run(False)
    packed = graph_ops().packed
    assert_bit_identical(expected, run(True))
    assert graph_ops().packed - packed == 4 * K * 2


class BrokenBlock(torch.nn.Module):
    """A block dynamo compiles as two graphs (a graph break between them)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        torch._dynamo.graph_break()
        return x + self.down(h.sin())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_block_with_a_graph_break(backend):
    """Without fullgraph=True (two graphs per block): the program is still the one
    compiled without offload, some saved tensors go through the ops, and bytes move."""

    def run(offload: bool) -> tuple[list[torch.Tensor], Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(BrokenBlock() for _ in range(3))
        handle = offload_layers(blocks, K, min_offload_numel=0, **GRAPH_OPS) if offload else None
        for block in blocks:
            block.compile(backend=backend)
        grads = []
        for seed in (1, 2):
            h = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
            for block in blocks:
                h = block(h)
            blocks.zero_grad(set_to_none=True)
            h.square().mean().backward()
            grads += [p.grad.clone() for p in blocks.parameters()]
        return grads, handle

    expected, _ = run(False)
    packed = graph_ops().packed
    actual, handle = run(True)
    assert_bit_identical(expected, actual)
    assert graph_ops().packed > packed
    assert handle.offload_synchronizer.stats.bytes_offloaded > 0
    handle.remove()


@pytest.mark.parametrize("style, order", AOT_EAGER)
def test_by_default_compiled_layers_keep_the_eager_hooks_and_move_their_inputs_too(style, order):
    """The default (``compiled_copies="hooks"``): nothing goes through the ops; the eager
    hooks around the compiled call see every saved tensor of the compiled function, the
    layers' inputs too, so more moves than through the ops (which see intermediates
    only), bit-identical all the same."""
    reference = Decoder("dict")
    model = copy.deepcopy(reference)
    compile_blocks(reference, style, "aot_eager")
    expected = [step(reference, seed) for seed in (1, 2)]
    packed = graph_ops().packed
    handle = offload_in_order(model, order, lambda m: compile_blocks(m, style, "aot_eager"), K)
    actual = [step(model, seed) for seed in (1, 2)]
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert graph_ops().packed == packed
    # the up projection's input, its output and the gelu's, per offloaded layer and step
    assert handle.offload_synchronizer.stats.tensors_offloaded == 3 * K * 2
    handle.remove()


def test_compiled_copies_takes_hooks_or_graph_ops():
    with pytest.raises(ValueError) as raised:
        offload_layers(Decoder("list"), K, compiled_copies="ops")
    assert str(raised.value) == (
        "offload_layers: compiled_copies must be 'hooks' (the default: layers compiled one "
        "by one hand their saved tensors to hooks around the compiled call) or 'graph_ops' "
        "(through ops inside the compiled graphs); got 'ops'."
    )


@pytest.mark.parametrize("mode", ["no_static", "all"])
def test_where_the_ops_cannot_go_the_eager_hooks_run_around_the_compiled_call(mode):
    """Under another filtering mode than "donated" (weights or inputs would go through
    the op), or a torch that inlines no hooks, the compiled call keeps the eager hooks
    around it: nothing goes through the ops, and the bytes still move."""
    with torch._functorch.config.patch(saved_tensors_hooks_filtering_mode=mode):
        expected, actual, handle, ops = run_both("in place", "offload first", "aot_eager", None)
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert ops == (0, 0)
    assert handle.offload_synchronizer.stats.bytes_offloaded > 0
    handle.remove()


@pytest.mark.parametrize("order", ["offload first", "compile first"])
def test_checkpoint_wrapped_layers_keep_the_eager_hooks_around_the_call(order):
    """A layer in a checkpoint wrapper compiled in place (torchtitan's AC, then its
    apply_compile) keeps the eager hooks around the compiled call, and nothing goes
    through the ops: torch 2.13's AOTAutograd fails to inline hooks into torchtitan's
    such graphs, and a graph checkpointed whole saves only its inputs, which it keeps
    from the ops (the ops would move nothing here)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    def wrap_and_compile(model: Decoder) -> None:
        for name, block in list(model.layers.named_children()):
            wrapped = checkpoint_wrapper(block)
            model.layers.register_module(name, wrapped)
            wrapped.compile(backend="aot_eager", fullgraph=True)

    reference = Decoder("dict")
    model = copy.deepcopy(reference)
    wrap_and_compile(reference)
    expected = [step(reference, seed) for seed in (1, 2)]
    packed = graph_ops().packed
    handle = offload_in_order(model, order, wrap_and_compile, K, **GRAPH_OPS)
    actual = [step(model, seed) for seed in (1, 2)]
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert graph_ops().packed == packed
    assert handle.offload_synchronizer.stats.bytes_offloaded > 0
    handle.remove()


@pytest.mark.parametrize("data", [False, True], ids=["shapes", "data"])
def test_a_compiled_block_on_the_modeled_accelerator_overlaps_its_copies(data):
    """aot_eager blocks on the modeled accelerator (NOTE [Compiled code on the
    simulator]): the copies of the ops run on the offload stream while the compute
    stream runs the next layers, as an eager layer's do."""
    device = modeled_device(link_bytes_per_s=2e10)
    width, rows = 256, 4096 if not data else 512

    def run(compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(MLPBlock(width) for _ in range(4))
        if compiled:
            for block in blocks:
                block.compile(backend="aot_eager", fullgraph=True)
        packed = graph_ops().packed
        with timed_runtime(device, data=data) as report:
            if not data:
                blocks.to("meta")
            x = torch.randn(rows, width, device="cpu" if data else "meta", requires_grad=True)
            handle = offload_layers(blocks, K, min_offload_numel=0, **GRAPH_OPS)
            h = x
            for block in blocks:
                h = block(h)
            h.sum().backward()
            handle.remove()
        grads = [p.grad for p in blocks.parameters()] if data else []
        return report, graph_ops().packed - packed, grads

    eager, _, eager_grads = run(False)
    compiled, packed, compiled_grads = run(True)
    assert packed == 2 * K
    assert compiled.d2h_bytes == compiled.h2d_bytes > 0
    for report in (eager, compiled):
        copies_s = report.d2h_bytes / device.d2h + report.h2d_bytes / device.h2d
        # the copies overlap compute: the step takes compute's time, not compute and
        # copies one after the other, and the compute stream hardly waits for them
        assert report.step_s < report.compute_s + 0.05 * copies_s
        assert report.exposed_copy_s < 0.05 * copies_s
    if data:
        assert_bit_identical(eager_grads, compiled_grads)


def test_the_offload_op_outside_an_offloaded_layer_says_what_to_do():
    from cpu_offload import CpuOffloadError

    with pytest.raises(CpuOffloadError, match="expected the layer's offload hooks around the"):
        torch.ops.cpu_offload.offload_saved.default(torch.ones(2))
