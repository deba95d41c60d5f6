"""The public API: signatures, validation, marks, the stable names."""

from __future__ import annotations

import contextlib
import inspect
import threading
from pathlib import Path

import pytest
import torch

import cpu_offload
from cpu_offload import (
    CpuOffloadError,
    get_cpu_offload_context,
    is_cpu_offload_enabled,
    mark_activation_offload,
    mark_not_offload,
)

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()


def test_public_names_are_the_stable_ones_the_readme_lists():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    names = cpu_offload.__all__
    assert len(set(names)) == len(names) == 17
    for name in names:
        assert hasattr(cpu_offload, name) and f"`{name}" in readme.replace("cpu_offload.", ""), name
    # Internals stay importable from their modules, not from the package.
    for internal in ("TensorGroupProcessor", "ForwardPass", "OffloadSynchronizer"):
        assert not hasattr(cpu_offload, internal)
    from cpu_offload.hooks.tensor_group import TensorGroupProcessor  # noqa: F401


def test_positional_order_is_te_compatible():
    params = list(inspect.signature(get_cpu_offload_context).parameters.values())
    assert [p.name for p in params[:9]] == [
        "enabled",
        "num_layers",
        "model_layers",
        "offload_activations",
        "offload_weights",
        "double_buffering",
        "manual_synchronization",
        "retain_pinned_cpu_buffers",
        "offload_stream",
    ]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[9:])
    assert [p.name for p in params[9:]] == [
        "device",
        "min_offload_numel",
        "min_offload_bytes",
        "max_host_bytes",
        "offloaded_layers",
        "keep_passes",
        "reload_slice_bytes",
        "reload_on_demand_layers",
        "cuda_graph",
    ]
    # Megatron passes them positionally.
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, True, False, False)
    assert hasattr(ctx, "offload_synchronizer")


def test_disabled_returns_null_context_and_identity():
    ctx, sync_fn = get_cpu_offload_context(False, num_layers=99, model_layers=-3)
    assert isinstance(ctx, contextlib.nullcontext)
    x = torch.randn(2)
    assert sync_fn(x) is x
    ctx, sync_fn, controller = get_cpu_offload_context(False, manual_synchronization=True)
    assert controller is None and sync_fn(x) is x


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(offload_activations=False), "nothing is chosen to offload"),
        (dict(num_layers=4, model_layers=4), r"0 <= num_layers <= model_layers - 1 = 3"),
        (dict(num_layers=-1, model_layers=4), "got num_layers=-1"),
        (dict(num_layers=None, model_layers=4), "got num_layers=None"),
        (dict(num_layers=0, model_layers=0), "model_layers must be an int >= 1"),
        (dict(offload_stream=object()), "only with manual_synchronization=True"),
        (dict(min_offload_numel=-1), "min_offload_numel must be an int >= 0"),
        (dict(device="meta"), "device=.meta. is not a device this offloader can use"),
    ],
    ids=["nothing", "k_eq_L", "k_negative", "k_none", "L_zero", "stream", "numel", "device"],
)
def test_invalid_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_cpu_offload_context(True, **{"num_layers": 1, "model_layers": 3, **kwargs})


def test_weights_only_is_a_null_context_as_in_transformer_engine():
    with pytest.warns(DeprecationWarning, match="offload_activations=False: nothing is"):
        ctx, sync_fn = get_cpu_offload_context(True, 1, 2, False, True)
    x = torch.randn(4, 4, requires_grad=True)
    with ctx:
        y = x.sin()
    assert sync_fn(y) is y
    assert not hasattr(ctx, "offload_synchronizer")  # nothing was set up
    with pytest.warns(DeprecationWarning):
        result = get_cpu_offload_context(True, 1, 2, False, True, manual_synchronization=True)
    assert result[2] is None


def test_offload_weights_is_deprecated():
    with pytest.warns(DeprecationWarning, match="offload_weights=True is deprecated"):
        get_cpu_offload_context(True, 1, 2, offload_weights=True)


def test_all_but_last_layer_warns():
    with pytest.warns(UserWarning, match="cannot overlap with compute"):
        get_cpu_offload_context(True, 3, 4)


def test_double_buffering_is_accepted():
    ctx, _ = get_cpu_offload_context(True, 1, 2, double_buffering=True)
    assert ctx.offload_synchronizer.num_offloaded_layers == 1


def test_enabled_only_inside_context_and_per_thread():
    ctx, sync_fn = get_cpu_offload_context(True, 0, 1)
    seen = {}

    def other_thread():
        seen["other"] = is_cpu_offload_enabled()

    assert not is_cpu_offload_enabled()
    with ctx:
        assert is_cpu_offload_enabled()
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["other"] is False
    assert not is_cpu_offload_enabled()


def test_entering_twice_and_sync_inside_are_errors():
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2)
    with ctx:
        with pytest.raises(CpuOffloadError, match="entered again before it was left"):
            ctx.__enter__()
        x = torch.randn(2, requires_grad=True) * 2
        with pytest.raises(CpuOffloadError, match="called inside the offload context"):
            sync_fn(x)


def test_sync_fn_passes_through_tensors_without_grad():
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2)
    with ctx:
        pass
    x = torch.randn(3)
    assert sync_fn(x) is x
    assert sync_fn("not a tensor") == "not a tensor"


def test_mark_activation_offload_has_no_effect(streams):
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    x = torch.randn(16, 16, requires_grad=True)
    for _ in range(2):
        with ctx:
            h = x * 3
            mark_activation_offload(h)
            x = h.sin()
        x = sync_fn(x)
    x.sum().backward()
    # Only sin's input of layer 0 is saved and offloaded; the mark changes nothing.
    assert ctx.offload_synchronizer.stats.tensors_offloaded == 1


def test_parameters_and_marked_tensors_are_never_offloaded(streams):
    weight = torch.nn.Parameter(torch.randn(32, 32))
    keep = torch.randn(32, 32)
    mark_not_offload(keep)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    x = torch.randn(32, 32, requires_grad=True)
    with ctx:
        # saves x and weight.t() (a view of a parameter), keep, and sin's input
        h = x @ weight.t()
        y = (h * keep).sin()
    y = sync_fn(y)
    with ctx:
        z = y.cos()
    layer0 = ctx.offload_synchronizer.layer_states[0]
    assert layer0.num_offloaded_tensors == 2  # x and sin's input
    copied = layer0._data.host
    assert any(torch.equal(buffer, x) for buffer in copied)
    assert not any(torch.equal(buffer, keep) for buffer in copied)
    assert not any(torch.equal(buffer, weight.detach().t()) for buffer in copied)
    z.sum().backward()
    assert weight.grad is not None


def test_mark_not_offload_rejects_non_tensors():
    with pytest.raises(TypeError, match="expected tensors, got int"):
        mark_not_offload(3)
