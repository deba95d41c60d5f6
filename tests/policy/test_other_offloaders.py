"""Another offloader on the same layers (NOTE [Two offloaders on one layer]): one warning
says which one moves what; gradients are what either computes alone.  transformers'
``offload=True``: tests/integrations/test_transformers.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload import offload_layers


def layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)]


def step(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        h = x
        for module in modules:
            h = module(h)
    h.sum().backward()
    return [x.grad, *(p.grad for m in modules for p in m.parameters())]


def test_offloaded_layers_inside_save_on_cpu_say_who_moves_what():
    expected = step(layers())
    modules = layers()
    handle = offload_layers(modules, 2, min_offload_numel=0)
    with pytest.warns(UserWarning, match="runs inside torch.autograd.graph.save_on_cpu: cpu"):
        actual = step(modules)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert handle.offload_synchronizer.stats.tensors_offloaded == 4  # 2 layers, 2 each
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per handle
        step(modules)
    handle.remove()
