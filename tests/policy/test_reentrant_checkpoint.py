"""Hooked layers inside a reentrant checkpoint (NOTE [Layers inside a reentrant
checkpoint]): the checkpoint's inputs move with the chunk's last layer, or one warning
says why they stay.  Parity rows: tests/offload/test_autograd_parity.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cpu_offload import offload_layers
from cpu_offload.hooks.autograd_hooks import top_saved_tensor_hooks


def blocks(n: int = 4, width: int = 16) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(n)]


def run_chunks(layers: list[torch.nn.Module], sizes: list[int], x: torch.Tensor) -> torch.Tensor:
    start = 0
    for size in sizes:
        chunk = layers[start : start + size]

        def run(h: torch.Tensor, chunk: list[torch.nn.Module] = chunk) -> torch.Tensor:
            for layer in chunk:
                h = layer(h)
            return h

        x = checkpoint(run, x, use_reentrant=True)
        start += size
    return x


def test_each_offloaded_chunks_input_moves_and_is_back_before_its_recompute():
    layers = blocks()
    handle = offload_layers(layers, 3, min_offload_numel=0)
    x = torch.randn(8, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chunks [0, 1], [2], [3]: nothing to say
        run_chunks(layers, [2, 1, 1], x).sum().backward()
    stats = handle.offload_synchronizer.stats
    assert (stats.tensors_offloaded, stats.bytes_offloaded) == (2, 2 * 8 * 16 * 4)
    assert stats.tensors_reloaded == 2 and stats.on_demand_reloads == 0
    assert top_saved_tensor_hooks() is None
    handle.remove()


def test_a_chunk_whose_last_layer_is_kept_says_its_input_stays():
    layers = blocks()
    handle = offload_layers(layers, 2, min_offload_numel=0)
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.warns(UserWarning, match=r"whose last layer, 2, is kept: the checkpoint's"):
        run_chunks(layers, [1, 2, 1], x).sum().backward()
    assert handle.offload_synchronizer.stats.tensors_offloaded == 1  # chunk [0]'s input
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per handle
        run_chunks(layers, [1, 2, 1], x).sum().backward()
    handle.remove()


def test_a_memory_budget_counts_them_and_moves_what_it_plans():
    """The budget's side: tests/policy/test_reentrant_budget.py."""
    layers = blocks()
    handle = offload_layers(layers, memory_budget="1KiB", min_offload_numel=0)
    x = torch.randn(8, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: each chunk's input is 512 B, and
        for _ in range(2):  # its recompute holds 512 B more (Tanh's output)
            run_chunks(layers, [1, 1, 1, 1], x).sum().backward()
    assert handle.plan.fits and handle.plan.predicted.peak_bytes == 1024
    assert handle.plan.policy == ["offload"] * 3 + ["keep"]
    assert handle.offload_synchronizer.stats.tensors_offloaded == 3  # 3 chunks' inputs
    handle.remove()


def test_a_checkpoint_that_saves_nothing_pushes_nothing():
    layers = blocks()
    handle = offload_layers(layers, 3, min_offload_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "None of the inputs have requires_grad"
        out = run_chunks(layers, [1, 1, 1, 1], torch.randn(8, 16))
        with torch.no_grad():
            run_chunks(layers, [2, 2], torch.randn(8, 16, requires_grad=True))
    assert not out.requires_grad and top_saved_tensor_hooks() is None
    assert handle.offload_synchronizer.stats.tensors_offloaded == 0
    handle.remove()


def test_a_checkpoint_that_raises_after_a_layer_leaves_no_hook_behind():
    layers = blocks()
    handle = offload_layers(layers, 3, min_offload_numel=0)

    def fails(h: torch.Tensor) -> torch.Tensor:
        layers[0](h)
        raise ValueError("after the layer")

    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="after the layer"):
        checkpoint(fails, x, use_reentrant=True)
    assert top_saved_tensor_hooks() is not None  # the chunk's hook, until the next layer
    run_chunks(layers, [1, 1, 1, 1], x).sum().backward()
    assert top_saved_tensor_hooks() is None
    assert handle.offload_synchronizer.stats.tensors_offloaded == 3
    expected = x.grad.clone()
    handle.remove()
    x.grad = None
    run_chunks(layers, [4], x).sum().backward()
    assert torch.equal(x.grad, expected)


def test_removing_the_hooks_takes_off_a_hook_left_by_a_checkpoint_that_raised():
    layers = blocks()
    handle = offload_layers(layers, 3, min_offload_numel=0)

    def fails(h: torch.Tensor) -> torch.Tensor:
        layers[0](h)
        raise ValueError("after the layer")

    with pytest.raises(ValueError, match="after the layer"):
        checkpoint(fails, torch.randn(8, 16, requires_grad=True), use_reentrant=True)
    handle.remove()
    assert top_saved_tensor_hooks() is None
