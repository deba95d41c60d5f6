"""The step report (``report()``), the reprs, the logs and the profiler ranges.

The report's figures are checked against the hook-level truth: what the pack hooks were
handed, recorded by a spy around ``OffloadableLayerState.push_tensor`` (or the
whole-forward context's pack hook), each tensor classified by ``selection.kept_because``.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
import torch
from report_truth import Spy, assert_row_matches, reason_of
from torch import nn

from cpu_offload import get_cpu_offload_context, mark_not_offload, offload_layers
from cpu_offload.chunked import ChunkedOffload
from cpu_offload.engine.layer_state import OffloadableLayerState
from cpu_offload.hooks.handles import is_moved_handle
from cpu_offload.integrations.torchtune import OffloadActivations
from cpu_offload.report.step_report import REASONS

#: the tests that copy run on every stream flavour (host, simulator, simulated runtimes)
streams = pytest.mark.usefixtures("streams")


class Mixed(nn.Module):
    """A layer that saves a tensor for each common reason to stay: parameters (a
    ``Parameter`` and a weight's view), under the threshold, marked, not dense."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # x (moves), weight.t() (a parameter)
        h = h * self.scale  # h (moves), scale (a parameter)
        mask = torch.ones_like(h)
        mark_not_offload(mask)
        h = h * mask  # mask: marked
        small = h.sum(1, keepdim=True)
        h = h * small  # small: under the threshold
        strided = h[:, ::8].sin()  # h[:, ::8]: not dense (its base is 8x larger)
        return h + strided.sum(1, keepdim=True)


def step(layers: list[nn.Module], ctx: Any, sync_fn: Any, batch: int = 32) -> torch.Tensor:
    x = torch.randn(batch, 64, requires_grad=True)
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync_fn(h)
    h.sum().backward()
    return x


def test_a_report_before_any_step_says_so():
    ctx, _ = get_cpu_offload_context(True, 1, 2)
    report = ctx.offload_synchronizer.report()
    assert report.step == 0 and report.to_dict() == {}
    assert "no step has completed yet" in str(report)
    assert str(ctx.report()) == str(report)


@pytest.mark.filterwarnings("ignore:cpu_offload. a non-contiguous saved tensor")
@streams
def test_the_context_api_reports_what_the_hooks_got(monkeypatch):
    spy = Spy(monkeypatch, min_numel=33)
    torch.manual_seed(0)
    layers = [Mixed() for _ in range(4)]
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=33)
    stats = ctx.offload_synchronizer.stats
    step(layers, ctx, sync_fn)
    spy.clear()
    before = (stats.bytes_offloaded, stats.bytes_reloaded)
    step(layers, ctx, sync_fn)
    report = ctx.offload_synchronizer.report()
    assert report.step == 2
    assert [row.choice for row in report.rows] == ["offload", "offload", "keep", "keep"]
    for row in report.rows[:2]:
        assert row.counted
        assert_row_matches(row, spy)
        assert set(row.kept_because) == {
            "parameter",
            "under the threshold",
            "marked not to offload",
            "not dense",
        }
    assert [row.counted for row in report.rows[2:]] == [False, False]
    assert report.rows[3].note == "the last layer: never offloaded"
    scalars = report.to_dict()
    assert scalars["saved_tensors"] == sum(len(v) for v in spy.saved.values())
    assert scalars["moved_tensors"] + scalars["kept_tensors"] == scalars["saved_tensors"]
    assert scalars["moved_bytes"] + scalars["kept_bytes"] == scalars["saved_bytes"]
    assert scalars["kept_tensors/marked"] == 2 and scalars["kept_tensors/not_dense"] == 2
    assert scalars["copied_bytes"] == stats.bytes_offloaded - before[0]
    assert scalars["reloaded_bytes"] == stats.bytes_reloaded - before[1]
    assert f"moved {scalars['moved_tensors']} tensors (" in str(report)
    assert "parameter: 2, under the threshold: 1, marked not to offload: 1, not dense" in str(
        report
    )


@streams
def test_a_policy_with_checkpointing_reports_the_recomputes(monkeypatch):
    spy = Spy(monkeypatch, min_numel=0)
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))
    recomputed: Counter[int] = Counter()
    for index, layer in enumerate(layers):  # the truth: the Linear runs inside backward
        layer[0].register_forward_pre_hook(
            lambda *_, index=index: recomputed.update(
                [index] if torch._C._current_graph_task_id() != -1 else []
            )
        )
    policy = ["offload", "checkpoint+offload", "checkpoint", "keep"]
    handle = offload_layers(layers, policy=policy, min_offload_numel=0)
    x = torch.randn(16, 64, requires_grad=True)
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    report = handle.report()
    assert [row.choice for row in report.rows] == policy
    assert recomputed == Counter({1: 1, 2: 1})
    assert [row.recomputed for row in report.rows] == [None, True, True, None]
    assert report.recomputed_layers == [1, 2]
    assert [row.counted for row in report.rows] == [True, True, False, False]
    for row in report.rows[:2]:
        assert_row_matches(row, spy)
    assert report.rows[1].saved_tensors == 1  # the checkpoint's input, nothing else
    assert report.to_dict()["recomputed_layers"] == 2
    assert "recomputed in backward" in str(report)
    handle.remove()


def test_a_checkpointed_layer_that_did_not_recompute_says_so():
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    handle = offload_layers(layers, policy=["checkpoint", "offload", "keep"], min_offload_numel=0)
    h = torch.randn(4, 8)  # the checkpointed layer's output needs no gradient...
    with torch.no_grad():
        h = layers[0](h)
    h = layers[2](layers[1](h.requires_grad_()))  # ...so backward never reaches it
    h.sum().backward()
    row = handle.report().rows[0]
    assert row.recomputed is False and row.note.startswith("NOT recomputed")
    handle.remove()


@streams
def test_offload_activations_reports_what_its_hook_got(monkeypatch):
    truth: list[tuple[int, str | None, bool]] = []  # bytes, reason, handed a copy
    original = ChunkedOffload._push

    def push(ctx: ChunkedOffload, tensor: Any) -> Any:
        handle = original(ctx, tensor)
        engine = ctx.offload_synchronizer
        why = reason_of(tensor, engine.backend.device, 0, engine.min_offload_bytes)
        truth.append((tensor.numel() * tensor.itemsize, why, not isinstance(handle, tuple)))
        return handle

    monkeypatch.setattr(ChunkedOffload, "_push", push)
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(128, 128), nn.GELU())))
    ctx = OffloadActivations()
    with ctx:
        loss = model(torch.randn(32, 128, requires_grad=True)).sum()
    assert ctx.report().step == 0  # the graph still holds the forward
    stats_before = ctx.offload_synchronizer.stats.bytes_offloaded
    loss.backward()
    report = ctx.report()
    assert report.step == 1 and report.unit == "chunk"
    assert all(row.choice == "chunk" and row.counted for row in report.rows)
    assert report.saved_tensors == len(truth)
    assert report.saved_bytes == sum(nbytes for nbytes, _, _ in truth)
    kept = report.kept_because
    last = kept.pop("in the last chunk", (0, 0))
    assert last[0] > 0  # the last chunk stays on the device at its defaults
    candidates = [nbytes for nbytes, why, _ in truth if why is None]
    assert (report.moved_tensors + last[0], report.moved_bytes + last[1]) == (
        len(candidates),
        sum(candidates),
    )
    expected: dict[str, list[int]] = {}
    for nbytes, why, _ in truth:
        if why is not None:
            entry = expected.setdefault(REASONS[why][1], [0, 0])
            entry[0] += 1
            entry[1] += nbytes
    assert kept == {reason: (t, b) for reason, (t, b) in expected.items()}
    assert report.moved_tensors + report.kept_tensors == report.saved_tensors
    assert report.to_dict()["copied_bytes"] == stats_before  # copies start in forward
    assert report.to_dict()["kept_tensors/last_chunk"] == last[0]


@streams
def test_the_host_cap_is_a_reason_to_stay():
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
    ctx, sync_fn = get_cpu_offload_context(
        True, 3, 4, min_offload_numel=0, max_host_bytes=f"{3 * 32 * 64 * 4}B"
    )
    with pytest.warns(UserWarning, match="max_host_bytes"):
        step(layers, ctx, sync_fn)
    report = ctx.report()
    stats = ctx.offload_synchronizer.stats
    capped = report.kept_because["over max_host_bytes"]
    assert capped == (stats.tensors_kept_by_host_cap, stats.bytes_kept_by_host_cap) != (0, 0)
    assert report.to_dict()["kept_tensors/host_cap"] == stats.tensors_kept_by_host_cap
    assert report.moved_tensors + report.kept_tensors == report.saved_tensors == 3 * 3


def test_a_tensor_saved_again_after_the_host_cap_kept_it_counts_as_kept():
    """A tensor saved in a later chunk is counted where its first save went: kept there by
    max_host_bytes, it is kept (not moved) in the later chunk too."""
    weights = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    for cap in (None, 20_000):
        ctx = ChunkedOffload(
            chunk_bytes=64 * 64 * 4, min_offload_numel=0, max_host_bytes=cap and f"{cap}B"
        )
        x = torch.randn(64, 64, requires_grad=True)
        with pytest.warns() if cap else contextlib.nullcontext(), ctx:
            h = x.sin()
            d = ((h @ weights[0]).cos() @ weights[1]).tanh() @ weights[2]
            loss = (d * h).sum()  # h again, three chunks later
        loss.backward()
        del loss
        report = ctx.report()
        stats = ctx.offload_synchronizer.stats
        capped = report.kept_because.get("over max_host_bytes", (0, 0))[0]
        if cap is None:  # the saves again count as moved, beside the copies made once
            assert capped == 0 and report.moved_tensors > stats.tensors_offloaded
        else:  # only the first chunk fits: the saves again of capped tensors stay
            assert report.moved_tensors == stats.tensors_offloaded == 1
            assert capped > stats.tensors_kept_by_host_cap > 0
        assert report.moved_tensors + report.kept_tensors == report.saved_tensors


def test_a_forward_dropped_or_raising_replaces_no_whole_forward_step():
    ctx = ChunkedOffload(chunk_bytes=4096, min_offload_numel=0)
    weight = torch.randn(64, 64, requires_grad=True)

    def forward(batch: int) -> torch.Tensor:
        h = torch.randn(batch, 64, requires_grad=True)
        with ctx:
            for _ in range(6):
                h = (h @ weight).tanh()
        return h.sum()

    forward(64).backward()
    first = ctx.report()
    loss = forward(8)  # evaluation with grad on: its graph is dropped
    del loss
    with pytest.raises(ValueError, match="in the forward"), ctx:
        (torch.randn(8, 64, requires_grad=True) @ weight).tanh()
        raise ValueError("in the forward")
    assert ctx.report().step == first.step and ctx.report().to_dict() == first.to_dict()
    forward(16).backward()
    assert ctx.report().step == first.step + 1


@streams
def test_a_layer_the_manual_controller_never_offloaded():
    layers = [nn.Linear(64, 64) for _ in range(3)]
    ctx, sync_fn, controller = get_cpu_offload_context(
        True, model_layers=3, manual_synchronization=True, min_offload_numel=0
    )
    x = torch.randn(8, 64, requires_grad=True)
    h = x
    for index, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync_fn(h)
        if index == 0:
            controller.start_offload_layer(0)
    controller.release_activation_forward_gpu_memory(0)
    controller.start_reload_layer(0)
    h.sum().backward()
    report = controller.report()
    assert [row.choice for row in report.rows] == ["manual"] * 3
    assert report.rows[0].moved_tensors == 1
    assert report.rows[1].kept_because == {
        "parameter": (1, 64 * 64 * 4),
        "offload never started": (1, 8 * 64 * 4),
    }
    assert report.to_dict()["kept_tensors/not_offloaded"] == 2


def test_the_last_backward_is_the_step_and_evaluation_replaces_nothing():
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)]
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
    outputs = []
    for batch in (8, 16):  # gradient accumulation: two forwards, then their backwards
        h = torch.randn(batch, 64, requires_grad=True)
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync_fn(h)
        outputs.append(h)
    outputs[1].sum().backward()
    outputs[0].sum().backward()
    first = ctx.report()
    assert first.step == 2 and first.rows[0].moved_bytes == 8 * 64 * 4 * 2  # batch 8
    with torch.no_grad():
        step_without_grad = torch.randn(4, 64)
        for layer in layers:
            with ctx:
                step_without_grad = layer(step_without_grad)
            sync_fn(step_without_grad)
    assert ctx.report().step == 2 and ctx.report().forward_pass == first.forward_pass


def test_memory_is_measured_where_the_device_reports_it(streams):
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)]
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0)
    step(layers, ctx, sync_fn)
    report = ctx.report()
    end = report.end_of_forward
    assert end is not None and end.released_bytes == 2 * 32 * 64 * 4
    assert end.host_in_use_bytes >= end.released_bytes
    measured = ctx.offload_synchronizer.backend.memory_allocated() is not None
    assert (end.device_bytes is not None) == measured
    scalars = report.to_dict()
    if measured:  # a simulated runtime: it reports memory (0)
        assert "keeping everything: up to" in str(report)
        assert scalars["device_bytes_keeping_everything"] == end.device_bytes + end.released_bytes
    else:
        assert "device memory: not known" in str(report)
        assert "device_bytes_end_of_forward" not in scalars


# ------------------------------------------------------------------ reprs


def test_reprs_say_where_the_layers_are_the_schedule_and_the_thresholds():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))

    handle = offload_layers(Model(), 2, min_offload_numel=7)
    text = repr(handle)
    assert text.startswith("OffloadLayersHandle(5 Linear at layers of Model; ")
    assert "layers 0-1 offload, 2-4 keep (k=2)" in text  # one way to say a schedule
    assert "min_offload_numel=7, min_offload_bytes=0, max_host_bytes=None" in text
    assert repr(handle.context) == (
        "OffloadContext(5 layers per forward pass, layers 0-1 offload, 2-4 keep (k=2); "
        "min_offload_numel=7, min_offload_bytes=0, max_host_bytes=None; device cpu)"
        if str(handle.offload_synchronizer.backend.device) == "cpu"
        else repr(handle.context)
    )
    handle.remove()
    assert repr(handle).endswith("; removed)")
    policy = ["offload", "checkpoint+offload", "checkpoint", "checkpoint", "keep"]
    handle = offload_layers(Model().layers, policy=policy)
    assert "at the list given; layers 0 offload, 1 checkpoint+offload, 2-3 checkpoint, 4 keep;" in (
        repr(handle)
    )
    handle.remove()
    ctx, _, _ = get_cpu_offload_context(True, model_layers=3, manual_synchronization=True)
    assert "3 layers per forward pass, a manual controller offloads" in repr(ctx)
    text = repr(OffloadActivations(max_host_bytes=2**20))
    assert text.startswith("OffloadActivations(whole forward in chunks growing with the forward")
    assert "min_offload_size=1024, max_host_bytes=1048576" in text
    assert "chunks of 4096 bytes" in repr(ChunkedOffload(chunk_bytes=4096))


# -------------------------------------------------------------------- logs


def test_decisions_and_warnings_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="cpu_offload"):
        handle = offload_layers(nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), 2)
        with pytest.warns(UserWarning, match="num_layers == model_layers - 1"):
            get_cpu_offload_context(True, 2, 3)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "cpu_offload"]
    assert ("INFO", f"offload_layers: {handle!r}") in messages
    assert any(level == "WARNING" and "model_layers - 1" in text for level, text in messages)
    handle.remove()


DEFAULT_LEVEL = """
import warnings, torch
from cpu_offload import get_cpu_offload_context, offload_layers
layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
handle = offload_layers(layers, 1, min_offload_numel=0)
h = torch.randn(8, 64, requires_grad=True)
for layer in layers:
    h = layer(h)
h.sum().backward()
handle.report()
if WARN:
    get_cpu_offload_context(True, 2, 3)
"""


@pytest.mark.parametrize("warn", [False, True], ids=["quiet", "a-warning"])
def test_nothing_more_is_printed_at_the_default_level(warn):
    result = subprocess.run(
        [sys.executable, "-c", f"WARN = {warn}\n" + DEFAULT_LEVEL],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout == ""
    if warn:  # the warning, once, as before: not a second time through logging
        assert result.stderr.count("num_layers == model_layers - 1") == 1
    else:
        assert result.stderr == ""


# --------------------------------------------------------------- profiler


@streams
def test_the_profiler_shows_copies_reloads_waits_and_releases():
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        step(layers, ctx, sync_fn)
    names = {event.name for event in profiler.events() if event.name.startswith("cpu_offload")}
    assert names == {
        f"cpu_offload::{operation} layer {layer}"
        for layer in (0, 1)
        for operation in ("offload", "release", "reload", "wait_reload", "release_all")
    }


def test_no_range_is_made_without_a_profiler(monkeypatch):
    import cpu_offload.report.profiler_ranges as ranges

    def refuse(name: str) -> None:
        raise AssertionError(f"a range was made without a profiler: {name}")

    monkeypatch.setattr(ranges, "record_function", refuse)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=0)
    step(layers, ctx, sync_fn)
    assert ctx.report().moved_tensors == 4


@streams
@pytest.mark.filterwarnings("ignore:cpu_offload. a non-contiguous saved tensor")
def test_moved_handles_are_what_the_report_counts_as_moved(monkeypatch):
    """The spy's classification agrees with the handles the pack hook returned."""
    handles: list[bool] = []
    original = OffloadableLayerState.push_tensor

    def push(state: OffloadableLayerState, tensor: Any) -> Any:
        handle = original(state, tensor)
        handles.append(is_moved_handle(handle))
        return handle

    monkeypatch.setattr(OffloadableLayerState, "push_tensor", push)
    layers = [Mixed() for _ in range(4)]
    ctx, sync_fn = get_cpu_offload_context(True, 2, 4, min_offload_numel=33)
    step(layers, ctx, sync_fn)
    assert ctx.report().moved_tensors == sum(handles) == 6


def test_figures_counting_the_same_thing_agree_and_a_schedule_is_said_one_way():
    """Issue 39: the copies the report counts are the statistics' bytes, and the handle and
    the context it made say the schedule in the same words."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4))
    )
    handle = offload_layers(model, 2, min_offload_numel=0)
    model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    stats, figures = handle.offload_synchronizer.stats, handle.report().to_dict()
    assert figures["copied_bytes"] == stats.bytes_offloaded == figures["reloaded_bytes"] > 0
    assert figures["saved_tensors"] == figures["moved_tensors"] + figures["kept_tensors"]
    words = "layers 0-1 offload, 2-3 keep (k=2)"
    assert words in repr(handle) and words in repr(handle.context)
    handle.remove()


def test_a_fresh_handle_counts_its_own_passes():
    """Each handle's report counts its forward passes from 0, whatever ran before it."""
    firsts = []
    for _ in range(2):
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(3)))
        handle = offload_layers(model, 1)
        for _ in range(2):
            model(torch.randn(512, 512, requires_grad=True)).sum().backward()
            firsts.append(str(handle.report()).splitlines()[0].split(":")[1])
        handle.remove()
    assert (
        firsts
        == [
            " step 1 (forward pass 0 and its backward)",
            " step 2 (forward pass 1 and its backward)",
        ]
        * 2
    ), firsts
