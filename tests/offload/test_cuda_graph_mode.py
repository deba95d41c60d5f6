"""``cuda_graph=``: the offloader inside a captured step (issue 53), on the simulated streams
with a capture whose rules are checked here: what CUDA refuses during a capture (a host
synchronisation, a wait on an event recorded outside the capture, a side stream used before
it forked from the capturing stream or left unjoined at the capture's end), and host
allocations in steady state.  (``record_stream`` is allowed: PyTorch's allocator keeps such
a block out of the capture's reuse until the capture ends.)  Gradients are compared with a
run without offload (``torch.equal``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.engine.layer_context import CAPTURE_REFUSED
from cpu_offload.errors import CpuOffloadError
from cpu_offload.testing import strict_streams

L, K, WIDTH = 4, 2, 32


class CaptureRules:
    """Wraps a simulated backend: while :attr:`capturing`, records what CUDA would refuse."""

    def __init__(self, sim: Any) -> None:
        self.sim, self.capturing = sim, False
        self.violations: list[str] = []
        self.host_allocations = self.copies = 0
        self._recorded: set[int] = set()  # events recorded in the capture
        self._forked: set[int] = set()  # side streams that waited on the capture
        self._last: dict[int, int] = {}  # side stream -> its queue length after its last copy
        self._joined: dict[int, int] = {}  # side stream -> the position the capture waited for
        self._wrap()

    def _wrap(self) -> None:
        sim = self.sim
        sim.is_capturing = lambda: self.capturing
        new_event, wait_event, copy = sim.new_event, sim.wait_event, sim.copy
        synchronize = sim.synchronize
        empty_host = sim.empty_host_bytes

        def made_event() -> Any:
            event = new_event()
            record, sync = event.record, event.synchronize

            def recorded(stream: Any = None) -> None:
                if self.capturing:
                    self._recorded.add(id(event))
                record(stream)

            def synced() -> None:
                self._refuse("an event's synchronize")
                sync()

            event.record, event.synchronize = recorded, synced
            return event

        def waited(stream: Any, event: Any) -> None:
            if self.capturing:
                if id(event) not in self._recorded:
                    self._refuse("a wait on an event recorded outside the capture")
                source = event.stream
                if stream.is_compute and source is not None and not source.is_compute:
                    self._joined[id(source)] = max(self._joined.get(id(source), 0), event.position)
                elif not stream.is_compute and (source is None or source.is_compute):
                    self._forked.add(id(stream))
                elif not stream.is_compute and id(source) in self._forked:
                    self._forked.add(id(stream))
            wait_event(stream, event)

        def copied(dst: Any, src: Any, stream: Any, label: str = "") -> None:
            if self.capturing:
                self.copies += 1
                if not stream.is_compute:
                    if id(stream) not in self._forked:
                        self._refuse("a side stream that did not fork from the capture")
                    copy(dst, src, stream, label)
                    self._last[id(stream)] = len(stream.queue)
                    return
            copy(dst, src, stream, label)

        def host_bytes(nbytes: int) -> Any:
            self.host_allocations += 1
            return empty_host(nbytes)

        sim.new_event, sim.wait_event, sim.copy = made_event, waited, copied
        sim.synchronize = lambda: (self._refuse("synchronize"), synchronize())
        sim.empty_host_bytes = host_bytes

    def _refuse(self, what: str) -> None:
        if self.capturing:
            self.violations.append(what)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """A capture: at its end, every side stream used in it must have been joined."""
        self.capturing = True
        self._recorded, self._forked, self._last, self._joined = set(), set(), {}, {}
        try:
            yield
        finally:
            unjoined = [s for s, last in self._last.items() if self._joined.get(s, -1) < last]
            if unjoined:
                self.violations.append("a side stream left unjoined at the capture's end")
            self.capturing = False


def make_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(L)]


def inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(16, WIDTH, requires_grad=True)


def step(layers: list[torch.nn.Module], x: torch.Tensor, ctx: Any = None, sync: Any = None) -> None:
    for layer in layers:
        if ctx is None:
            x = layer(x)
            continue
        with ctx:
            x = layer(x)
        x = sync(x)
    x.square().sum().backward()


def grads(layers: list[torch.nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for layer in layers for p in layer.parameters()]  # type: ignore[misc]


def eager_grads(steps: int = 1) -> list[torch.Tensor]:
    layers, x = make_layers(), inputs()
    for _ in range(steps):
        step(layers, x)
    return grads(layers, x)


@pytest.mark.parametrize("scope", [True, "step"])
def test_a_whole_step_captured_after_warm_up_keeps_the_capture_rules(scope):
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=scope)
        layers, x = make_layers(), inputs()
        step(layers, x, ctx, sync)  # warm-up
        warm = ctx.offload_synchronizer.stats
        moved = (warm.bytes_offloaded, warm.bytes_reloaded)
        allocated = rules.host_allocations
        with rules.capture():
            step(layers, x, ctx, sync)
    assert rules.violations == []
    assert rules.host_allocations == allocated > 0  # the warm-up's buffers, kept
    assert rules.copies > 0
    stats = ctx.offload_synchronizer.stats
    assert (stats.bytes_offloaded, stats.bytes_reloaded) == (2 * moved[0], 2 * moved[1])
    assert all(torch.equal(a, b) for a, b in zip(grads(layers, x), eager_grads(2)))
    report = ctx.report()
    assert report.cuda_graph.captured and report.cuda_graph.replay
    scalars = report.to_dict()
    assert scalars["cuda_graph/captured"] == scalars["cuda_graph/replay"] == 1
    assert scalars["cuda_graph/warmup_steps"] == 1
    assert scalars["copied_bytes"] == moved[0]


def test_the_default_mode_under_capture_says_to_pass_cuda_graph():
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0)
        layers, x = make_layers(), inputs()
        with rules.capture(), pytest.raises(CpuOffloadError) as raised:
            step(layers, x, ctx, sync)
    assert str(raised.value) == CAPTURE_REFUSED
    assert "Pass cuda_graph=True" in str(raised.value)


def test_cuda_graph_outside_any_capture_runs_as_eager_and_says_so():
    with strict_streams():
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        layers, x = make_layers(), inputs()
        step(layers, x, ctx, sync)
        step(layers, x, ctx, sync)
    assert all(torch.equal(a, b) for a, b in zip(grads(layers, x), eager_grads(2)))
    report = ctx.report()
    assert not report.cuda_graph.captured and not report.cuda_graph.replay
    assert report.to_dict()["cuda_graph/warmup_steps"] == 2
    assert "eager, before any capture" in str(report)
    assert report.host_allocations == 0  # the first step's buffers, kept per layer


def test_an_eager_step_after_the_capture_is_no_replay():
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        layers, x = make_layers(), inputs()
        step(layers, x, ctx, sync)
        with rules.capture():
            step(layers, x, ctx, sync)
        step(layers, x, ctx, sync)
    steps = ctx.report().cuda_graph
    found = (steps.captured, steps.replay, steps.captures, steps.warmup_steps)
    assert found == (False, False, 1, 1)


def per_layer_graphs(ctx: Any, sync: Any, rules: CaptureRules, layers: list, x: torch.Tensor):
    """``make_graphed_callables``' order: each layer's forward captured on its own static
    input, then each layer's backward, last layer first, each a capture of its own."""
    statics = [x.detach().clone().requires_grad_() for _ in layers]
    outputs = []
    for layer, static in zip(layers, statics):
        with rules.capture():
            with ctx:
                out = layer(static)
            outputs.append(sync(out))
    results = []
    for layer, static, out in reversed(list(zip(layers, statics, outputs))):
        with rules.capture():
            surface = (static, *layer.parameters())
            results.append(torch.autograd.grad(out, surface, torch.ones_like(out)))
    return results[::-1]


def test_per_layer_graphs_finish_each_copy_in_the_graph_that_started_it():
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph="layer")
        layers, x = make_layers(), inputs()
        found = per_layer_graphs(ctx, sync, rules, layers, x)
    assert rules.violations == []
    stats = ctx.offload_synchronizer.stats
    assert stats.bytes_offloaded == stats.bytes_reloaded > 0
    baseline = make_layers()
    for layer, got in zip(baseline, found):
        static = x.detach().clone().requires_grad_()
        out = layer(static)
        expected = torch.autograd.grad(out, (static, *layer.parameters()), torch.ones_like(out))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert ctx.report().cuda_graph.captured


def test_per_layer_graphs_under_the_step_schedule_break_the_rules_it_would_need():
    """The reason for ``"layer"``: the step schedule starts a layer's offload in the next
    layer's graph and joins it in a later one."""
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        per_layer_graphs(ctx, sync, rules, make_layers(), inputs())
    assert rules.violations


def test_offload_layers_takes_cuda_graph_and_refuses_a_budget_with_it():
    layers = torch.nn.ModuleList(make_layers())
    handle = offload_layers(layers, K, min_offload_numel=0, cuda_graph=True)
    assert handle.offload_synchronizer.cuda_graph == "step"
    assert "cuda_graph='step'" in repr(handle.context)
    handle.remove()
    with pytest.raises(TypeError, match="cuda_graph= does not combine with it"):
        offload_layers(layers, memory_budget="1GiB", cuda_graph=True)


def test_offload_layers_under_capture_with_graphs_that_save_nothing_reports_replays():
    """Module hooks run around a graphed layer's replay: a forward whose layers saved
    nothing after a capture is a replay, not a step of its own."""
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        layers = torch.nn.ModuleList(make_layers())
        handle = offload_layers(layers, K, min_offload_numel=0, cuda_graph=True)
        x = inputs()
        step(list(layers), x)
        with rules.capture():
            step(list(layers), x)
        for layer in layers:  # a graphed layer's replay saves nothing for autograd
            layer.forward = lambda y: y + 1
        step(list(layers), x)
        handle.remove()
    assert rules.violations == []
    steps = handle.report().cuda_graph
    assert (steps.captured, steps.replay) == (True, True)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"manual_synchronization": True}, "manual_synchronization= decides per step"),
        ({"keep_passes": 1}, "keep_passes= decides per step"),
        ({"reload_slice_bytes": 1024}, "reload_slice_bytes= decides per step"),
    ],
)
def test_options_that_decide_per_step_are_refused_with_cuda_graph(options, words):
    with pytest.raises(ValueError, match=words):
        get_cpu_offload_context(True, 1, L, cuda_graph=True, **options)


@pytest.mark.parametrize("value", ["yes", 1, None, "Layer"])
def test_cuda_graph_takes_a_bool_step_or_layer(value):
    with pytest.raises(TypeError, match="cuda_graph must be False, True"):
        get_cpu_offload_context(True, 1, L, cuda_graph=value)


def test_the_buffers_a_graph_copies_into_are_not_freed_after_a_capture():
    with strict_streams() as sim:
        rules = CaptureRules(sim)
        ctx, sync = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        pool = ctx.offload_synchronizer.host_buffers
        layers, x = make_layers(), inputs()
        step(layers, x, ctx, sync)
        pool.empty_cache()  # before any capture: freed, as without graphs
        assert pool.stats()["reserved_bytes"] == 0
        step(layers, x, ctx, sync)
        with rules.capture():
            step(layers, x, ctx, sync)
        reserved = pool.stats()["reserved_bytes"]
        with pytest.raises(CpuOffloadError, match="a captured CUDA graph copies into"):
            pool.empty_cache()
    assert pool.stats()["reserved_bytes"] == reserved > 0
