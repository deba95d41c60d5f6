"""What a newcomer gets wrong is answered in their terms, at the call."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.models.llama import Llama, LlamaConfig


@pytest.mark.parametrize(
    "flag",
    ["enabled", "offload_activations", "manual_synchronization", "retain_pinned_cpu_buffers"],
)
def test_an_on_off_flag_that_is_not_a_bool_is_a_type_error(flag):
    options = {"enabled": True, "num_layers": 1, "model_layers": 2, flag: "yes"}
    with pytest.raises(TypeError, match=rf"cpu_offload: {flag} must be True or False, got str"):
        get_cpu_offload_context(**options)


def test_a_device_type_without_streams_names_the_choices():
    with pytest.raises(ValueError, match=r"device='tpu' is not a device .* 'cpu', 'cuda', 'npu'"):
        get_cpu_offload_context(True, 1, 4, device="tpu")


@pytest.mark.parametrize("k", [4, 10, -1])
def test_offload_layers_answers_in_k_and_the_layers_found(k):
    model = Llama(LlamaConfig(layers=4))
    with pytest.raises(ValueError) as error:
        offload_layers(model, k)
    message = str(error.value)
    assert f"offload_layers: k={k} but 4 layers were found (in Llama)" in message
    assert "0..3" in message and "num_layers" not in message and "manual" not in message


def test_sync_fn_passes_none_and_tuples_through():
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    pair = (torch.ones(1), torch.ones(1))
    assert sync_fn(None) is None and sync_fn(pair) is pair


def run_layers(ctx, sync_fn, layers, x):
    for layer in layers:
        with ctx:
            x = layer(x).relu()
        x = sync_fn(x)
    return x


def test_more_layers_than_model_layers_warn_once():
    layers = [nn.Linear(64, 64) for _ in range(6)]
    ctx, sync_fn = get_cpu_offload_context(True, 1, 4, min_offload_numel=0)
    with pytest.warns(UserWarning, match="more layers ran under the context than model_layers=4"):
        run_layers(ctx, sync_fn, layers, torch.randn(8, 64, requires_grad=True)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once; and the right count never warns
        run_layers(ctx, sync_fn, layers[:4], torch.randn(8, 64, requires_grad=True))
        ctx2, sync2 = get_cpu_offload_context(True, 1, 4, min_offload_numel=0)
        for _ in range(3):  # consecutive steps are not chained layers
            run_layers(ctx2, sync2, layers[:4], torch.randn(8, 64, requires_grad=True))


def test_a_pass_that_moves_nothing_because_of_the_threshold_warns_once():
    layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
    handle = offload_layers(layers, 0.5)  # every saved tensor is under the default threshold
    x = torch.randn(8, 64, requires_grad=True)
    with pytest.warns(UserWarning) as record:
        h = x
        for layer in layers:
            h = layer(h)
    (warning,) = [w for w in record if "offloaded nothing" in str(w.message)]
    message = str(warning.message)
    assert "min_offload_numel=262144 (the largest had 512)" in message
    assert "2 offloaded layers" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for layer in layers:
            h = layer(h)
    handle.remove()
    moved = offload_layers(layers, 0.5, min_offload_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # something moves: no warning
        for layer in layers:
            x = layer(x)
    assert moved.offload_synchronizer.stats.tensors_offloaded > 0


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_second_offload_layers_on_hooked_layers_is_refused(streams):
    """Issue 39: the second call was accepted and the first handle silently moved
    nothing; it is refused, naming the first handle, and after its remove() a new call
    offloads as before, with the gradients of the plain model."""
    model, x = _stack(), torch.randn(32, 64)
    plain = _grads(model, x)
    first = offload_layers(model, 2, min_offload_numel=0)
    with pytest.raises(RuntimeError) as raised:
        offload_layers(model, policy=["offload", "keep", "keep", "keep"], min_offload_numel=0)
    assert str(raised.value) == (
        f"offload_layers: layer 0 (Sequential) is already hooked by an earlier offload_layers "
        f"call, {first!r}; a second set of hooks would leave that handle moving nothing. Call "
        "handle.remove() on the earlier handle first, or keep using it."
    )
    with pytest.raises(RuntimeError, match="already hooked"):
        offload_layers(list(model)[1:], memory_budget="1GiB")  # any of its layers
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model, x)))
    assert first.offload_synchronizer.stats.tensors_offloaded > 0  # the first still moves
    first.remove()
    second = offload_layers(model, 1, min_offload_numel=0)
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model, x)))
    assert second.offload_synchronizer.stats.tensors_offloaded > 0
    second.remove()


def test_an_unknown_keyword_of_offload_layers_is_named_as_its_own():
    with pytest.raises(TypeError) as raised:
        offload_layers(_stack(), 1, min_offload_size=1024)
    assert str(raised.value).startswith(
        "offload_layers() got an unexpected keyword argument 'min_offload_size'; it takes "
        "num_offloaded_layers (k), policy=, memory_budget=, modules=, copy_bandwidth=, "
        "compiled_copies= and "
        "these keywords of get_cpu_offload_context(): offload_activations,"
    )


def test_trls_threshold_is_named_as_typed():
    from cpu_offload.integrations.torchtune import (
        OffloadActivations,
        get_act_offloading_ctx_manager,
    )

    with pytest.raises(ValueError) as raised:
        OffloadActivations(min_offload_size=-1)
    assert str(raised.value) == (
        "OffloadActivations: min_offload_size must be an int >= 0 (bytes), got -1."
    )
    with pytest.raises(TypeError) as raised:
        get_act_offloading_ctx_manager(_stack(), min_offload_size=1.5)
    assert str(raised.value) == (
        "get_act_offloading_ctx_manager: min_offload_size must be an int >= 0 (bytes), got 1.5."
    )
