"""Offload with compiled layers (issue 50): each layer compiled with ``fullgraph=True``,
in place or wrapped, before or after ``offload_layers``; a whole model compiled; layers in
a ``ModuleDict``.  Each is bit-identical, with torch on one thread, to the same compiled
program without offload."""

from __future__ import annotations

import copy

import pytest
import torch
from compiled_blocks import WIDTH, Decoder, K, L, compile_blocks, step
from helpers import MLPBlock, assert_bit_identical, forward, offload_in_order
from torch import nn

from cpu_offload import offload_layers


def run_both(container: str, style: str, order: str, backend: str):
    """Gradients of two steps without and with offload, and the handle."""
    reference = Decoder(container)
    model = copy.deepcopy(reference)
    compile_blocks(reference, style, backend)
    expected = [step(reference, seed) for seed in (1, 2)]
    handle = offload_in_order(model, order, lambda m: compile_blocks(m, style, backend), K)
    actual = [step(model, seed) for seed in (1, 2)]
    return expected, actual, handle


@pytest.mark.parametrize("order", ["offload first", "compile first"])
@pytest.mark.parametrize("style", ["in place", "wrapped"])
@pytest.mark.parametrize("container", ["dict", "list"])
def test_fullgraph_blocks_aot_eager(container, style, order):
    expected, actual, handle = run_both(container, style, order, "aot_eager")
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    stats = handle.offload_synchronizer.stats
    assert stats.forward_passes == 2
    assert stats.tensors_offloaded > 0 and stats.bytes_offloaded > 0
    handle.remove()


@pytest.mark.parametrize(
    "style, order", [("in place", "offload first"), ("wrapped", "compile first")]
)
def test_fullgraph_blocks_inductor(style, order):
    expected, actual, handle = run_both("dict", style, order, "inductor")
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert handle.offload_synchronizer.stats.bytes_offloaded > 0
    handle.remove()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_whole_compiled_model_is_the_program_compiled_without_offload(backend):
    """torch.compile(model) after offload_layers: the hooks add no graph break
    (fullgraph=True compiles), the gradients are those of the model compiled without
    offload, and the handle warns that the whole-model graph offloaded nothing."""
    reference = Decoder("dict")
    model = copy.deepcopy(reference)
    expected = [
        step(torch.compile(reference, backend=backend, fullgraph=True), seed) for seed in (1, 2)
    ]
    handle = offload_layers(model, K, min_offload_numel=0)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with pytest.warns(UserWarning, match="a model compiled as a whole runs its layers inside one"):
        actual = [step(compiled, seed) for seed in (1, 2)]
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert handle.offload_synchronizer.stats.forward_passes == 0
    handle.remove()


def test_layers_in_a_module_dict_are_found_in_iteration_order():
    model = Decoder("dict")
    model.layers = nn.ModuleDict({key: model.layers[key] for key in ("2", "0", "1")})
    handle = offload_layers(model, K, min_offload_numel=0)
    assert handle.found.startswith(
        "3 MLPBlock at layers (a ModuleDict: layers 0-2 are keys '2'..'1'"
    )
    assert "in iteration order) of Decoder" in repr(handle)
    assert handle.policy == ["offload", "offload", "keep"]
    step(model, 1)
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    handle.remove()
    single = offload_layers(nn.ModuleDict({"only": MLPBlock(WIDTH)}), 0)
    assert single.found == (
        "1 MLPBlock at the ModuleDict given (a ModuleDict: layer 0 is key 'only')"
    )
    single.remove()


def test_the_context_around_fullgraph_blocks():
    from cpu_offload import get_cpu_offload_context

    reference = Decoder("list")
    compile_blocks(reference, "in place", "aot_eager")
    blocks = reference.blocks()

    def run(ctx=None, sync_fn=None) -> list[torch.Tensor]:
        reference.zero_grad(set_to_none=True)
        h = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
        forward(blocks, h, ctx, sync_fn).square().mean().backward()
        return [p.grad.clone() for p in reference.parameters() if p.grad is not None]

    expected = run()
    ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0)
    assert_bit_identical(expected, run(ctx, sync_fn))
    assert ctx.offload_synchronizer.stats.tensors_offloaded > 0


def test_a_list_compiled_after_offloads_from_the_first_step_and_remove_restores():
    """Given a list (no model whose forward would find them), layers compiled in place
    after offload_layers offload from the first step: the first layer's hooks run around
    its compiled forward (frames dynamo leaves as written: NOTE [Hooks around compiled
    code]), and each layer gives the next its entry."""
    reference = Decoder("list")
    model = copy.deepcopy(reference)
    compile_blocks(reference, "in place", "aot_eager")
    expected = [step(reference, seed) for seed in (1, 2)]
    handle = offload_layers(model.blocks(), K, min_offload_numel=0)
    compile_blocks(model, "in place", "aot_eager")
    compiled = [block._compiled_call_impl for block in model.blocks()]
    actual = [step(model, seed) for seed in (1, 2)]
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert handle.offload_synchronizer.stats.forward_passes == 2
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    handle.remove()
    assert [block._compiled_call_impl for block in model.blocks()] == compiled


def test_a_policy_of_offload_and_keep_on_compiled_layers():
    reference = Decoder("dict")
    model = copy.deepcopy(reference)
    compile_blocks(reference, "in place", "aot_eager")
    expected = [step(reference, seed) for seed in (1, 2)]
    handle = offload_layers(model, policy=["keep", "offload", "keep"], min_offload_numel=0)
    compile_blocks(model, "in place", "aot_eager")
    actual = [step(model, seed) for seed in (1, 2)]
    for want, got in zip(expected, actual):
        assert_bit_identical(want, got)
    assert handle.offload_synchronizer.stats.tensors_offloaded > 0
    handle.remove()


REFUSED = [
    ({"memory_budget": "1KiB"}, "memory_budget= cannot go with layers compiled one by one"),
    ({"modules": ["up"], "num_offloaded_layers": 1}, "modules= cannot go with layers compiled"),
    (
        {"policy": ["checkpoint", "offload", "keep"]},
        'policy= with "checkpoint" choices cannot go with layers compiled one by one',
    ),
]


@pytest.mark.parametrize("options, match", REFUSED, ids=["budget", "modules", "checkpoint"])
@pytest.mark.parametrize("order", ["offload first", "compile first"])
@pytest.mark.parametrize("style", ["in place", "wrapped"])
def test_options_whose_hooks_run_inside_the_layer_are_refused_with_compiled_layers(
    options, match, order, style
):
    """One clear error that names what works, never a dynamo traceback: at offload_layers
    when the layers are compiled already (in place, or torch.compile(block) wrappers in
    their list), else at the first forward."""
    from cpu_offload import CpuOffloadError

    model = Decoder("dict")
    if order == "compile first":
        compile_blocks(model, style, "aot_eager")
        with pytest.raises(CpuOffloadError, match=match) as caught:
            offload_layers(model, min_offload_numel=0, **options)
    else:
        handle = offload_layers(model, min_offload_numel=0, **options)
        compile_blocks(model, style, "aot_eager")
        with pytest.raises(CpuOffloadError, match=match) as caught:
            step(model, 1)
        handle.remove()
    assert 'With compiled layers pass k, or policy= of "offload" and "keep"' in str(caught.value)
    offload_layers(model, K, min_offload_numel=0).remove()  # nothing was left hooked
