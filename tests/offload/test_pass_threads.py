"""Offload by pass with one model in two threads (NOTE [A backward queue per thread] in
pass_schedule.py): a pass's backward never brings back, nor moves whole, another
thread's pass; each thread's passes queue for their own backwards."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from helpers import make_input, make_layers

from cpu_offload import get_cpu_offload_context
from cpu_offload.engine import layer_data

#: a guard against a hang: no interleaving below waits on a timeout
JOIN_S = 60


def in_threads(*bodies: Callable[[], None]) -> list[BaseException]:
    """Run each body in its own thread; what each raised."""
    raised: list[BaseException] = []

    def run(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            raised.append(error)

    threads = [threading.Thread(target=run, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
        assert not thread.is_alive(), "a thread hung"
    return raised


def forward(layers, x, ctx, sync_fn) -> torch.Tensor:
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync_fn(x)
    return x


def test_a_backward_never_reloads_another_threads_pass(monkeypatch):
    """Thread A's pass waits for its backward while thread B runs a pass; A's backward
    starts while B's pass waits, and B's backward runs while A is inside any reload it
    issued of B's pass (forced: such a reload waits for B's backward to end).  Before the
    queue was per thread, A brought B's moved pass back and B popped a layer whose
    reload had started but not filled in (IndexError in the pop)."""
    layers = make_layers("mlp", 3, 16, torch.float32)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0, keep_passes=1)
    stats = ctx.offload_synchronizer.stats
    a_forward, b_forward, b_may_go, b_done = (threading.Event() for _ in range(4))
    passes: dict[str, int] = {}  # thread name -> index of its pass
    reloads: list[tuple[str, str]] = []  # (thread, layer name) of each reload
    copy_in = layer_data.LayerData.copy_in

    def paused_copy_in(data, layer) -> None:
        me = threading.current_thread().name
        reloads.append((me, layer.name))
        if me == "A" and layer.name.endswith(f"forward pass {passes['B']}"):
            b_may_go.set()  # A is inside a reload of B's pass: B's backward runs now
            assert b_done.wait(JOIN_S)
        copy_in(data, layer)

    monkeypatch.setattr(layer_data.LayerData, "copy_in", paused_copy_in)

    def thread_a() -> None:
        out = forward(layers, make_input("mlp", 16, torch.float32, 0), ctx, sync_fn)
        passes["A"] = ctx.offload_synchronizer.waiting_passes()[-1].index
        a_forward.set()
        assert b_forward.wait(JOIN_S)
        out.sum().backward()
        b_may_go.set()  # A's backward is over without touching B's pass

    def thread_b() -> None:
        assert a_forward.wait(JOIN_S)
        out = forward(layers, make_input("mlp", 16, torch.float32, 1), ctx, sync_fn)
        mine = [p for p in ctx.offload_synchronizer.in_flight_passes() if p.index != passes["A"]]
        passes["B"] = mine[-1].index
        b_forward.set()
        assert b_may_go.wait(JOIN_S)
        try:
            out.sum().backward()
        finally:
            b_done.set()

    raised = in_threads(named("A", thread_a), named("B", thread_b))
    assert raised == []
    owner = {str(index): name for name, index in passes.items()}
    for thread, layer in reloads:
        assert owner[layer.rsplit(" ", 1)[1]] == thread, (thread, layer)
    assert stats.passes_moved_whole == 0  # each thread had one pass in flight
    assert stats.on_demand_reloads == 0
    assert stats.tensors_offloaded == stats.tensors_reloaded > 0


def named(name: str, body: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        threading.current_thread().name = name
        body()

    return run


class Turns:
    """Steps of several threads run in a given order: ``take(i)`` waits for turn ``i``,
    ``done()`` hands on to the next."""

    def __init__(self) -> None:
        self.turn = 0
        self.changed = threading.Condition()

    def take(self, turn: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.turn == turn, JOIN_S)

    def done(self) -> None:
        with self.changed:
            self.turn += 1
            self.changed.notify_all()


def interleaved_steps(layers, ctx, sync_fn) -> dict[str, list[torch.Tensor]]:
    """Two threads, each F F B B on one model, their steps alternating (A F0, B F0, A F1,
    B F1, A B0, B B0, A B1, B B1); the input gradients of each thread's passes."""
    turns = Turns()
    grads: dict[str, list[torch.Tensor]] = {}

    def thread(name: str, first_turn: int) -> Callable[[], None]:
        def body() -> None:
            inputs, outputs = [], []
            for step in range(4):
                turns.take(first_turn + 2 * step)
                try:
                    if step < 2:
                        x = make_input("mlp", 16, torch.float32, first_turn + 2 * step)
                        inputs.append(x.requires_grad_())
                        if ctx is None:
                            outputs.append(plain(layers, x))
                        else:
                            outputs.append(forward(layers, x, ctx, sync_fn))
                    else:
                        outputs[step - 2].sum().backward()
                finally:
                    turns.done()
            grads[name] = [x.grad for x in inputs]

        return body

    assert in_threads(thread("A", 0), thread("B", 1)) == []
    return grads


def plain(layers, x) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.usefixtures("streams")
def test_each_threads_passes_move_whole_behind_its_own():
    layers = make_layers("mlp", 3, 16, torch.float32)
    expected = interleaved_steps(layers, None, None)
    ctx, sync_fn = get_cpu_offload_context(True, 1, 3, min_offload_numel=0, keep_passes=1)
    stats = ctx.offload_synchronizer.stats
    actual = interleaved_steps(layers, ctx, sync_fn)
    for name in ("A", "B"):
        assert all(torch.equal(a, b) for a, b in zip(expected[name], actual[name]))
    # each thread's second pass started behind its first: moved whole, brought back
    # behind its own thread's first backward, never reloaded on demand
    assert (stats.forward_passes, stats.passes_moved_whole) == (4, 2)
    assert stats.on_demand_reloads == 0
    assert stats.tensors_offloaded == stats.tensors_reloaded > 0
    assert ctx.offload_synchronizer.in_flight_passes() == []
