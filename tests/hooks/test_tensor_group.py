"""View-to-base and deduplication of a layer's tensors, and their undo."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import OffloadableLayerState, start_offload
from cpu_offload.device.runtime import get_backend
from cpu_offload.hooks import selection
from cpu_offload.hooks.tensor_group import TensorGroup, TensorGroupProcessor

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()


def offload_and_reload(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    backend = get_backend("cpu")
    state = OffloadableLayerState(backend.new_stream(), backend=backend, min_offload_numel=0)
    handles = [state.push_tensor(t) for t in tensors]
    state.start_offload()
    copies = state.num_offloaded_tensors
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    return [state.pop_tensor(h) for h in handles], copies


def test_one_tensor_saved_three_times_is_copied_once(streams):
    x = torch.randn(32, 32)
    popped, copies = offload_and_reload([x, x, x])
    assert copies == 1
    assert popped[0] is popped[1] is popped[2]
    assert torch.equal(popped[0], x)
    if streams is not None:
        assert streams.counters.copies_queued == 2  # one D2H, one H2D


def test_qkv_views_copy_one_base_and_keep_strides(streams):
    qkv = torch.randn(2, 16, 3 * 24)
    q, k, v = (t.view(2, 16, 4, 6).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    start_offload(q, k, v, offload_base_tensor=True)
    popped, copies = offload_and_reload([q, k, v])
    assert copies == 1
    for original, back in zip((q, k, v), popped):
        assert back.shape == original.shape and back.stride() == original.stride()
        assert back.storage_offset() == original.storage_offset()
        assert torch.equal(back, original)
    assert popped[0].untyped_storage().data_ptr() == popped[2].untyped_storage().data_ptr()


def test_unmarked_views_that_are_not_dense_move_through_their_base(streams):
    """q, k, v of one fused qkv output: the base is copied once, the views come back."""
    qkv = torch.randn(2, 16, 3 * 24)
    q, k, v = qkv.chunk(3, dim=-1)
    popped, copies = offload_and_reload([q, k, v])
    assert copies == 1  # the base, once
    for before, after in zip((q, k, v), popped):
        assert after is not before and torch.equal(after, before)
        assert (after.stride(), after.storage_offset()) == (
            before.stride(),
            before.storage_offset(),
        )
    assert popped[0].untyped_storage().data_ptr() == popped[2].untyped_storage().data_ptr()


def test_unmarked_view_of_a_much_larger_base_stays(streams, recwarn, monkeypatch):
    monkeypatch.setattr(selection, "_warned_sites", set())
    base = torch.randn(2, 16, 5 * 24)
    view = base[..., :24]  # a fifth of its base: copying the base is not worth it
    popped, copies = offload_and_reload([view])
    assert copies == 0 and popped[0] is view
    messages = [str(w.message) for w in recwarn if "non-contiguous" in str(w.message)]
    assert messages and "its base is 5x larger" in messages[0]
    assert "start_offload(t, offload_base_tensor=True)" in messages[0]


def test_processor_round_trip_on_plain_groups():
    base = torch.randn(8, 8)
    a, b = base.t(), torch.randn(4)
    group = TensorGroup()
    for tensor in (a, b, a, base):
        group.append(tensor, None)
    unique = TensorGroupProcessor.process_before_offload(group)
    assert [t is base for t in unique.tensor_list] == [True, False]
    assert unique.aux.source_index == [0, 1, 0, 0]
    reloaded = TensorGroup([t.clone() for t in unique.tensor_list], [None, None], unique.aux)
    restored = TensorGroupProcessor.process_after_reload(reloaded)
    assert [t.stride() for t in restored.tensor_list] == [(1, 8), (1,), (1, 8), (8, 1)]
    assert all(torch.equal(x, y) for x, y in zip((a, b, a, base), restored.tensor_list))


def test_skip_warning_is_shown_once_per_call_site_not_per_step(streams, monkeypatch):
    import warnings

    from cpu_offload import get_cpu_offload_context

    monkeypatch.setattr(selection, "_warned_sites", set())
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(8, 40, requires_grad=True)
            for _layer in range(2):
                with ctx:
                    x = x[:, :8].sin() * 2  # saves a slice of a 5x larger base: stays
                x = sync_fn(x)
            x.sum().backward()
    skipped = [w for w in caught if "non-contiguous" in str(w.message)]
    assert len(skipped) == 1
    assert skipped[0].filename == __file__


def test_dense_permuted_tensor_without_base_keeps_its_strides(streams):
    x = torch.empty_strided((2, 4, 16, 8), (512, 8, 32, 1)).normal_()
    assert x._base is None and not x.is_contiguous()
    popped, copies = offload_and_reload([x])
    assert copies == 1 and popped[0] is not x
    assert popped[0].stride() == x.stride() and torch.equal(popped[0], x)


def test_is_dense():
    assert selection.is_dense(torch.randn(3, 4).t())
    assert selection.is_dense(torch.randn(1, 5)[:, :])
    assert not selection.is_dense(torch.randn(4, 6)[:, :3])
    assert not selection.is_dense(torch.randn(4).expand(3, 4))
