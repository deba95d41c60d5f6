"""What stays on the device, and the messages that say so (with the offload's parity)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_bit_identical

from cpu_offload import get_cpu_offload_context, mark_not_offload, start_offload
from cpu_offload.hooks import selection

pytestmark = pytest.mark.usefixtures("streams")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which call sites have warned, so each parametrization sees its warning."""
    monkeypatch.setattr(selection, "_warned_sites", set())


def run(layer_fns, x, k=1, manual=False, **options):
    """Gradient of ``x`` and the synchronizer, through ``len(layer_fns)`` layers."""
    result = get_cpu_offload_context(
        True,
        None if manual else k,
        len(layer_fns),
        manual_synchronization=manual,
        min_offload_numel=0,
        **options,
    )
    ctx, sync_fn = result[0], result[1]
    x = x.detach().requires_grad_()
    h = x
    for fn in layer_fns:
        with ctx:
            h = fn(h)
        h = sync_fn(h)
    h.sum().backward()
    return x.grad, ctx.offload_synchronizer


def baseline(layer_fns, x):
    x = x.detach().requires_grad_()
    h = x
    for fn in layer_fns:
        h = fn(h)
    h.sum().backward()
    return x.grad


@pytest.mark.parametrize("view", ["view", "t", "itself"])
def test_mark_not_offload_covers_views_of_the_marked_storage(view):
    mask = torch.rand(8, 8)
    mark_not_offload(mask)
    saved = {"view": lambda: mask.view(8, 8), "t": lambda: mask.t(), "itself": lambda: mask}[view]
    fns = [lambda h: (h * saved()).sin(), torch.sin]
    x = torch.randn(8, 8)
    grad, synchronizer = run(fns, x)
    assert torch.equal(grad, baseline(fns, x))
    # Layer 0 saves the mask (kept) and the product (moved): one 8 x 8 float tensor moves.
    assert synchronizer.stats.tensors_offloaded == 1
    assert synchronizer.stats.bytes_offloaded == 8 * 8 * 4


def test_autocast_casts_of_parameters_are_not_offloaded():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, 16) for _ in range(3)]
    x = torch.randn(4, 16)

    def step(offload: bool):
        for linear in linears:
            linear.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if offload:
                grad, synchronizer = run(linears, x)
            else:
                grad, synchronizer = baseline(linears, x), None
        return [grad, *(p.grad.clone() for linear in linears for p in linear.parameters())], (
            synchronizer
        )

    expected, _ = step(False)
    actual, synchronizer = step(True)
    assert_bit_identical(expected, actual)
    # Layer 0 saves its bf16 input (moved) and the cached bf16 weight (kept, like a weight).
    assert synchronizer.stats.tensors_offloaded == 1
    assert synchronizer.stats.bytes_offloaded == 4 * 16 * 2


@pytest.mark.usefixtures("fresh_warnings")
def test_zero_element_tensors_stay_without_a_warning():
    fns = [lambda h: h[:, :0].sin().sum() + h.sin(), torch.cos, torch.sin]
    x = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad, _ = run(fns, x)
    assert not [w for w in caught if "non-contiguous" in str(w.message)]
    assert torch.equal(grad, baseline(fns, x))


@pytest.mark.usefixtures("fresh_warnings")
def test_non_contiguous_warning_once_per_call_site_whatever_the_shape():
    def strided(h):
        return h[:, ::8].sin()  # saves a strided slice, an eighth of its base: stays

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in range(4, 20):
            run([strided, torch.cos, torch.sin], torch.randn(seq, 8))
    messages = [str(w.message) for w in caught if "non-contiguous" in str(w.message)]
    assert len(messages) == 1, messages
    assert "shown once per call site" in messages[0]


def test_on_demand_reload_advice_fits_the_mode():
    def stop_early(manual: bool) -> str:
        result = get_cpu_offload_context(
            True, None if manual else 1, 3, manual_synchronization=manual, min_offload_numel=0
        )
        ctx = result[0]
        x = torch.randn(4, 4, requires_grad=True)
        h = x
        for index in range(3):  # sync_fn is never called: nothing is prefetched
            with ctx:
                h = h.sin()
            if manual and index == 0:
                result[2].start_offload_layer(0)
                result[2].release_activation_forward_gpu_memory(0)
        with pytest.warns(UserWarning, match="reloaded now") as caught:
            h.sum().backward()
        return str(caught[0].message)

    assert "sync function" in stop_early(manual=False)
    assert "start_reload_layer" not in stop_early(manual=False)
    assert "start_reload_layer" in stop_early(manual=True)


@pytest.mark.usefixtures("fresh_warnings")
def test_start_offload_inside_torch_compile_changes_the_advice(streams):
    if streams is not None:
        pytest.skip("dynamo runs the function uncompiled under the simulator's dispatch mode")

    def attention_like(h):
        qkv = h @ torch.ones(8, 48)
        q, k, v = qkv.chunk(6, dim=-1)[:3]  # a sixth of the base each: not moved unasked
        start_offload(q, k, v, offload_base_tensor=True)
        return (q * k).sin() * v

    compiled = torch.compile(attention_like, backend="eager")  # dynamo runs the FX graph
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(4, 8)
        grad, _ = run([compiled, torch.cos, torch.sin], x, k=1)
    messages = [str(w.message) for w in caught if "non-contiguous" in str(w.message)]
    assert messages and "saved by a torch.compile'd region" in messages[0]
    assert "Call start_offload(t, offload_base_tensor=True)" not in messages[0]
    assert torch.equal(grad, baseline([attention_like, torch.cos, torch.sin], x))
