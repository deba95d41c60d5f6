"""The census split per submodule and per kind of operation (plan/module_census.py)."""

from __future__ import annotations

import math

import pytest

from cpu_offload.device.profiles import get_profile
from cpu_offload.plan import measure_layer
from cpu_offload.plan.layers import preset_layer
from cpu_offload.plan.module_census import costs_by


@pytest.mark.parametrize("attention", ["cpu", "flash", "math"])
@pytest.mark.parametrize("by", ["module", "kind"])
def test_the_parts_add_up_to_the_layer(by, attention):
    """Bytes, FLOPs, kernels and recompute cost of the parts sum to the layer's, exactly
    (the CPU's flash attention has no FLOP formula: its FLOPs come after the forward)."""
    spec = preset_layer("tiny")
    layer = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=0, attention=attention)
    device = get_profile("h100")
    parts = costs_by(layer, by, device)
    assert sum(p.saved_bytes for p in parts.values()) == layer.saved_bytes
    assert sum(p.forward_flops for p in parts.values()) == layer.forward_flops
    assert sum(p.forward_kernels for p in parts.values()) == len(layer.forward_kernels)
    recomputed = [k for p in parts.values() for k in p.recompute_kernels]
    assert sorted(recomputed) == sorted(layer.recompute_kernels)
    assert sum(p.recompute_flops for p in parts.values()) == sum(
        f for f, _ in layer.recompute_kernels
    )
    whole = math.fsum(device.kernel_seconds(*k) for k in layer.recompute_kernels)
    assert math.isclose(sum(p.recompute_s for p in parts.values()), whole, rel_tol=1e-12)
    assert whole > 0


def test_the_parts_are_where_the_work_is():
    """Projections' FLOPs are theirs (2 * tokens * in * out), attention's are the
    layer's own code's, norms launch kernels but no counted FLOPs, and the last
    projection is not recomputed (non-reentrant checkpointing stops at the last save)."""
    spec = preset_layer("tiny")  # hidden 256, ffn 688, heads 4/2, seq 512, batch 2
    layer = measure_layer(spec.make_layer, spec.inputs, attention="flash")
    tokens = 2 * 512
    modules = costs_by(layer, "module")
    assert modules["q"].forward_flops == 2 * tokens * 256 * 256
    assert modules["gate"].forward_flops == modules["up"].forward_flops == 2 * tokens * 256 * 688
    assert modules["down"].forward_flops == 2 * tokens * 688 * 256
    assert modules["down"].recompute_kernels == [] and modules["q"].recompute_kernels
    assert modules["attn_norm"].forward_flops == 0 and modules["attn_norm"].forward_kernels > 0
    kinds = costs_by(layer, "kind")
    assert kinds["attention"].forward_flops == layer.forward_flops - kinds["matmul"].forward_flops
    assert kinds["norm"].forward_kernels == 2 * modules["attn_norm"].forward_kernels


def test_costs_by_refuses_what_it_cannot_split():
    spec = preset_layer("tiny")
    layer = measure_layer(spec.make_layer, spec.inputs)
    with pytest.raises(ValueError, match=r"costs_by: by must be 'module' or 'kind', got 'op'"):
        costs_by(layer, "op")
    layer.forward_sites = []
    with pytest.raises(ValueError, match="costs_by: the profile has no site per forward kernel"):
        costs_by(layer, "kind")
