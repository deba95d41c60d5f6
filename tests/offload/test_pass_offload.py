"""Offload by pass (``keep_passes``): passes beyond the ``N`` whose backwards come next move
whole, and come back before their backward (NOTE [Moving a pass whole] in pass_schedule.py)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from helpers import PIPELINE_ORDERS as ORDERS
from helpers import assert_bit_identical, forward, make_input, make_layers, run_pipeline_order

from cpu_offload import LayerState, get_cpu_offload_context, offload_layers
from cpu_offload.testing import timed_runtime

#: orders that run each pass's backward in the order of the forwards
FIFO = ("1f1b", "1f1b-deep", "gpipe", "one-at-a-time")


def moved_whole_in(order: str, keep_passes: int) -> int:
    """Passes of ``order`` that start with ``keep_passes`` or more older passes waiting
    for their backward: the passes the schedule moves whole."""
    waiting: list[str] = []
    moved = 0
    for step in order.split():
        if step[0] == "F":
            moved += len(waiting) >= keep_passes
            waiting.append(step[1:])
        else:
            waiting.remove(step[1:])
    return moved


def run_order(layers, order: str, k: int | None, keep_passes: int | None = None):
    """The gradients after ``order``, and the context (None without offload)."""
    if k is None:
        return run_pipeline_order(layers, order, None)
    return run_pipeline_order(layers, order, k, keep_passes=keep_passes)


@pytest.mark.usefixtures("streams")
@pytest.mark.parametrize("name", list(ORDERS))
@pytest.mark.parametrize(("keep_passes", "k"), [(1, 1), (2, 0)], ids=["keep1-k1", "keep2-k0"])
def test_pass_offload_bit_identical_in_pipeline_orders(name, keep_passes, k):
    layers = make_layers("mlp", 4, 32, torch.float32)
    expected, _ = run_order(layers, ORDERS[name], None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual, ctx = run_order(layers, ORDERS[name], k, keep_passes)
    assert_bit_identical(expected, actual)
    synchronizer = ctx.offload_synchronizer
    stats = synchronizer.stats
    assert synchronizer.get_offloaded_total_size_mb() == 0  # nothing left on the host
    assert synchronizer.in_flight_passes() == []
    assert synchronizer.host_memory_stats()["in_use_bytes"] == 0
    moved = moved_whole_in(ORDERS[name], keep_passes)
    assert stats.passes_moved_whole == moved
    # a moved pass copies every layer: 4 layers x (input, hidden, activation) of 16 rows
    assert stats.tensors_offloaded >= 12 * moved
    assert stats.tensors_offloaded == stats.tensors_reloaded
    on_demand = [w for w in caught if "keep_passes" in str(w.message)]
    if name in FIFO:  # each moved pass came back, prefetched, before its backward
        assert stats.on_demand_reloads == 0 and not on_demand
    elif moved:  # a younger pass's backward first: reloaded on demand, said once
        assert stats.on_demand_reloads > 0 and len(on_demand) == 1


class Scale(torch.nn.Module):
    """A layer that saves nothing for backward (its gradient is a constant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


@pytest.mark.usefixtures("streams")
@pytest.mark.parametrize("name", ["gpipe", "reverse"])
@pytest.mark.parametrize("empty", [1, 3], ids=["middle-saves-nothing", "last-saves-nothing"])
def test_a_moved_pass_with_a_layer_that_saves_nothing_comes_back_layer_by_layer(name, empty):
    """A moved pass comes back a layer at a time from its last layer down; a layer with
    nothing on the host is passed over, the next one down reloaded in its place, and the
    gradients stay bit-identical in order and out of order."""
    layers = make_layers("mlp", 4, 32, torch.float32)
    layers[empty] = Scale()
    expected, _ = run_order(layers, ORDERS[name], None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reverse: reloaded on demand, said once
        actual, ctx = run_order(layers, ORDERS[name], 0, keep_passes=1)
    assert_bit_identical(expected, actual)
    stats = ctx.offload_synchronizer.stats
    assert stats.passes_moved_whole == 3
    assert stats.tensors_offloaded == stats.tensors_reloaded >= 3 * 3 * 2
    assert ctx.offload_synchronizer.get_offloaded_total_size_mb() == 0
    # in order each came back prefetched; out of order a last layer that holds data is
    # reloaded on demand (one that holds nothing leaves the next one a layer's backward)
    assert (stats.on_demand_reloads == 0) == (name == "gpipe" or empty == 3)


@pytest.mark.usefixtures("streams")
def test_a_moved_pass_whose_last_layer_saves_nothing_prefetches_the_layer_below():
    """The layer a moved pass brings back first holds nothing on the host: the layer
    below it comes back in its place, behind the older pass's backward, not when the
    pass's own backward reaches it (without overlap)."""
    layers = make_layers("mlp", 4, 32, torch.float32)
    layers[3] = Scale()
    ctx, sync_fn = get_cpu_offload_context(True, 0, 4, min_offload_numel=0, keep_passes=1)
    synchronizer = ctx.offload_synchronizer
    outs = [
        forward(layers, make_input("mlp", 32, torch.float32, s).requires_grad_(), ctx, sync_fn)
        for s in range(3)
    ]
    second = synchronizer.in_flight_passes()[1]
    assert second.moved_whole and second.layer_states[3].num_offloaded_tensors == 0
    outs[0].square().mean().backward()  # B0: the next pass comes back
    done, back = LayerState.OFFLOAD_FINISHED, LayerState.RELOAD_STARTED
    assert [s.state for s in second.layer_states] == [done, done, back, back]
    for out in outs[1:]:
        out.square().mean().backward()
    assert synchronizer.stats.on_demand_reloads == 0


@pytest.mark.usefixtures("streams")
def test_passes_beyond_keep_move_whole_and_come_back_before_their_backward():
    layers = make_layers("mlp", 4, 32, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 4, min_offload_numel=0, keep_passes=1)
    synchronizer = ctx.offload_synchronizer
    outs = [
        forward(layers, make_input("mlp", 32, torch.float32, s).requires_grad_(), ctx, sync_fn)
        for s in range(3)
    ]  # 1F1B's warm-up on the first of four stages: F0 F1 F2
    first, second, third = synchronizer.in_flight_passes()
    states = [[s.state for s in p.layer_states] for p in (first, second, third)]
    done, kept = LayerState.OFFLOAD_FINISHED, LayerState.NOT_OFFLOADED
    assert states[0] == [done, kept, kept, kept]  # the per-layer schedule, k=1
    assert states[1] == states[2] == [done] * 4  # moved whole, the last layer included
    assert not first.moved_whole and second.moved_whole and third.moved_whole
    whole = sum(s.get_offloaded_total_size_mb() for s in second.layer_states)
    assert second.get_offloaded_total_size_mb() == whole == 4 * first.get_offloaded_total_size_mb()
    back = LayerState.RELOAD_STARTED
    outs[0].square().mean().backward()  # B0: the next pass's last layer comes back
    assert [s.state for s in second.layer_states] == [done, done, done, back]
    assert [s.state for s in third.layer_states] == [done] * 4
    outs[1].square().mean().backward()  # its other layers came back as its backward ran
    assert [s.state for s in third.layer_states] == [done, done, done, back]
    outs[2].square().mean().backward()
    assert synchronizer.stats.on_demand_reloads == 0
    assert synchronizer.stats.passes_moved_whole == 2


def test_a_moved_pass_holds_on_the_device_only_what_its_graph_holds_outside():
    """On the modeled accelerator (shapes only): in 1F1B's warm-up, a pass kept holds its
    activations, a pass moved whole only its input (a leaf) and its output."""
    width, rows = 256, 512
    layers = [
        torch.nn.Sequential(torch.nn.Linear(width, width, device="meta"), torch.nn.ReLU())
        for _ in range(4)
    ]
    activation = rows * width * 4

    def warm_up(keep_passes):
        grown = []
        with timed_runtime("h100") as run:
            memory = run.live.memory
            ctx, sync_fn = get_cpu_offload_context(
                True, 0, 4, min_offload_numel=0, keep_passes=keep_passes
            )
            outs = []
            for _ in range(3):
                before = memory.allocated
                x = torch.empty(rows, width, device="meta", requires_grad=True)
                outs.append(forward(layers, x, ctx, sync_fn))
                memory.poll()
                grown.append(memory.allocated - before)
            for out in outs:
                out.sum().backward()
        return grown

    # without moving: the input, and 4 layers' ReLU outputs (the last one is the output)
    assert warm_up(None) == [5 * activation] * 3
    assert warm_up(1) == [5 * activation, 2 * activation, 2 * activation]
    assert warm_up(2) == [5 * activation, 5 * activation, 2 * activation]


def test_offload_layers_takes_keep_passes():
    layers = make_layers("mlp", 4, 32, torch.float32)
    expected, _ = run_order(layers, ORDERS["gpipe"], None)
    layers.zero_grad(set_to_none=True)
    with offload_layers(layers, 1, min_offload_numel=0, keep_passes=1) as handle:
        assert "keep 1 pass, others moved whole" in repr(handle)
        outs = [layers_out(layers, s) for s in range(4)]
        for out in outs:
            out.square().mean().backward()
        stats = handle.offload_synchronizer.stats
    assert_bit_identical(expected, [p.grad.clone() for p in layers.parameters()])
    assert stats.passes_moved_whole == 3 and stats.on_demand_reloads == 0


def layers_out(layers, seed):
    x = make_input("mlp", 32, torch.float32, seed=seed).requires_grad_()
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize(
    ("value", "error", "said"),
    [
        (0, ValueError, "got 0"),
        (-2, ValueError, "got -2"),
        (1.5, TypeError, "got float 1.5"),
        (True, TypeError, "got bool True"),
        ("2", TypeError, "got str '2'"),
    ],
)
def test_keep_passes_refused_with_what_was_typed(value, error, said):
    with pytest.raises(error, match=f"keep_passes must be an int >= 1.*{said}"):
        get_cpu_offload_context(True, 1, 4, keep_passes=value)
    with pytest.raises(error, match=f"keep_passes must be an int >= 1.*{said}"):
        offload_layers(make_layers("mlp", 4, 32, torch.float32), 1, keep_passes=value)


def test_keep_passes_refused_with_manual_synchronization():
    with pytest.raises(ValueError, match="keep_passes=1 chooses which passes"):
        get_cpu_offload_context(True, model_layers=4, manual_synchronization=True, keep_passes=1)


def test_offload_activations_refuses_keep_passes():
    from cpu_offload.integrations.torchtune import OffloadActivations

    with pytest.raises(TypeError, match="OffloadActivations: keep_passes=2 is for the per-layer"):
        OffloadActivations(keep_passes=2)


@pytest.mark.usefixtures("streams")
def test_a_forward_without_grad_is_no_pass_moved_whole_nor_counted():
    """NOTE [A pass that saves nothing] in forward_pass.py: with a training pass waiting
    and ``keep_passes=1``, a ``torch.no_grad()`` forward moves nothing and counts nowhere;
    its output held, the next training pass is second in the queue, not third."""
    layers = make_layers("mlp", 3, 16, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0, keep_passes=1)
    synchronizer = ctx.offload_synchronizer
    stats = synchronizer.stats
    first = forward(layers, make_input("mlp", 16, torch.float32, 0), ctx, sync_fn)
    copied = stats.tensors_offloaded
    with torch.no_grad():
        evaluated = forward(layers, make_input("mlp", 16, torch.float32, 1), ctx, sync_fn)
    assert (stats.forward_passes, stats.passes_moved_whole) == (1, 0)
    assert stats.tensors_offloaded == copied
    assert len(synchronizer.waiting_passes()) == 1
    second = forward(layers, make_input("mlp", 16, torch.float32, 0), ctx, sync_fn)
    assert (stats.forward_passes, stats.passes_moved_whole) == (2, 1)
    assert [p.moved_whole for p in synchronizer.waiting_passes()] == [False, True]
    first.sum().backward()
    second.sum().backward()
    assert stats.on_demand_reloads == 0 and stats.tensors_offloaded == stats.tensors_reloaded
    assert "in 2 forward passes (1 moved whole)" in str(stats)
    del evaluated


@pytest.mark.usefixtures("streams")
def test_a_pass_counts_from_its_first_layer_run_with_grad():
    """A frozen first layer under ``torch.no_grad()``: the pass counts, and moves whole,
    from the layer that runs with grad."""
    layers = make_layers("mlp", 3, 16, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0, keep_passes=1)
    stats = ctx.offload_synchronizer.stats

    def frozen_first() -> torch.Tensor:
        h = make_input("mlp", 16, torch.float32, 0)
        for index, layer in enumerate(layers):
            with torch.no_grad() if index == 0 else contextlib.nullcontext(), ctx:
                h = layer(h)
            h = sync_fn(h)
        return h

    outs = [frozen_first(), frozen_first()]
    assert (stats.forward_passes, stats.passes_moved_whole) == (2, 1)
    for out in outs:
        out.sum().backward()
    assert stats.tensors_offloaded == stats.tensors_reloaded > 0
