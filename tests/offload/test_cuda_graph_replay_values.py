"""Parity under CUDA graphs with real values (issue 53): a training step captured on the
modeled accelerator in the data mode and replayed computes what the same step computes
eagerly without offload.

Which flavours can capture: only ``timed_runtime`` (its :class:`TimedRuntime` models
``CUDAGraph`` and ``graph``: NOTE [Modeled CUDA graphs]), and only its data mode
computes values (NOTE [Data-mode replay]): a capture records the operators, runs
nothing that stays, and each replay runs them again on the strict simulator's streams,
where every hazard of NOTE [Strict stream simulation] raises.  The other flavours of the
parity tests cannot: the host path has no streams, and ``strict_streams()`` /
``strict_runtime()`` model streams and events but no capture (their rows in
test_autograd_parity.py fake the capture flag and run the work eagerly).  The data mode
runs on CPU tensors; both of ``timed_runtime``'s runtimes (cuda, npu) are rows here.

Whole steps are captured by the runtime's own ``graph`` (``run.live.graph``), per-layer
graphs by torch's own ``make_graphed_callables`` under
:func:`~cpu_offload.testing.modeled_cuda.modeled_graph_calls` (torch.cuda's graphs and
streams the runtime's, tensors left on the CPU).  Its warm-up iterations run on a side
stream, which the strict simulator refuses for compute, so an eager warm-up step on the
default stream comes first and ``num_warmup_iters=0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_graph_steps import (
    InContext,
    Moved,
    Outer,
    Replays,
    StaticStep,
    assert_replays_eager,
    assert_values_and_bytes,
    capture_and_replay,
    squared_loss,
)
from helpers import assert_bit_identical, modeled_device

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.engine import layer_state, transitions
from cpu_offload.errors import CpuOffloadError
from cpu_offload.graphs.graph_synchronizer import capture_changed
from cpu_offload.testing import StreamHazardError, strict_streams, timed_runtime
from cpu_offload.testing.cuda_graphs import CAPTURED_EVENT, FREED, UNJOINED, CaptureError
from cpu_offload.testing.modeled_cuda import modeled_graph_calls

L, K, W, BATCH = 4, 2, 32, 8
DEVICE = modeled_device()
FLAVOURS = ["cuda", "npu"]
POLICY = ["checkpoint+offload", "checkpoint", "offload", "keep"]


def layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(W, 2 * W), torch.nn.GELU(), torch.nn.Linear(2 * W, W))
        for _ in range(L)
    )


def inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, W, generator=generator) for _ in range(3)]


def expected() -> list[list[torch.Tensor]]:
    """Per input: the loss, the input's gradient and the parameters', without offload."""
    model, found = layers(), []
    for x in inputs():
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        loss = squared_loss(model, leaf)
        loss.backward()
        found.append([loss.detach(), leaf.grad, *(p.grad for p in model.parameters())])
    return found


def offloaded(api: str, model: torch.nn.ModuleList, scope: Any) -> tuple[Any, Any, Any]:
    """``model`` offloaded through ``api`` with ``cuda_graph=scope``: the context and
    sync_fn to run its layers in (None for ``offload_layers``, which hooks them) and
    what reports."""
    if api == "get_cpu_offload_context":
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=scope)
        return ctx, sync_fn, ctx
    if api == "offload_layers, a policy with checkpoints":  # recomputes in the backward
        handle = offload_layers(model, policy=POLICY, min_offload_numel=0, cuda_graph=scope)
    else:
        handle = offload_layers(model, K, min_offload_numel=0, cuda_graph=scope)
    return None, None, handle


def whole_step(flavour: str, api: str, plant: Callable[[Any], Any] | None = None) -> Replays:
    """An eager warm-up step with offload, then the step captured whole by the runtime's
    ``graph`` and replayed for each input, the input copied into the static one first
    (``plant(synchronizer)`` runs before the capture: a planted bug)."""
    model, xs, found = layers(), inputs(), Replays()
    step = StaticStep(model, (BATCH, W))
    with timed_runtime(DEVICE, flavour=flavour, data=True) as run:
        live = run.live
        strict = live.strict
        step.ctx, step.sync_fn, reports = offloaded(api, model, True)

        def before_capture() -> None:
            if plant is not None:
                plant(reports.offload_synchronizer)

        capture_and_replay(live, step, step.grads, step.load, xs, found, before_capture)
        found.report = reports.report()
    found.hazards = strict.counters.hazards
    return found


@pytest.mark.parametrize("scope", [True, "layer"])
def test_eager_steps_between_replays_and_replays_after_them_compute_eager_values(scope):
    """The same context runs eager steps (evaluation, a step outside the graph) between
    replays; they share its fixed host buffers.  ``"layer"`` under a whole-step graph
    joins each layer's copies early: slower, the same values."""
    want, model, xs = expected(), layers(), inputs()
    step = StaticStep(model, (BATCH, W))
    grads = step.grads
    with timed_runtime(DEVICE, data=True) as run:
        live, strict = run.live, run.live.strict
        step.ctx, step.sync_fn, _ = offloaded("get_cpu_offload_context", model, scope)
        step.load(xs[0])
        moved = Moved(live)
        step()
        eager_bytes = moved.since()
        graph = live.CUDAGraph()
        with live.graph(graph, stream=live.Stream()):
            static_loss = step()
        for number, how in [
            (0, "replay"),
            (1, "eager"),
            (2, "replay"),
            (1, "replay"),
            (2, "eager"),
        ]:
            step.load(xs[number])
            moved = Moved(live)
            if how == "replay":
                graph.replay()
                loss = static_loss
            else:
                loss = step()
            assert moved.since() == eager_bytes, how
            assert_bit_identical(want[number], [loss.detach(), *grads])
    assert strict.counters.hazards == 0 and eager_bytes[0] > 0


def per_layer(flavour: str, api: str, scope: Any = "layer") -> Replays:
    """An eager warm-up step, then every layer's forward and backward captured by
    ``make_graphed_callables``, and a step through the graphed layers per input."""
    model, xs, found = layers(), inputs(), Replays()
    with timed_runtime(DEVICE, flavour=flavour, data=True) as run, modeled_graph_calls(run.live):
        live = run.live
        strict = live.strict
        ctx, sync_fn, reports = offloaded(api, model, scope)
        if ctx is None:
            callables = tuple(Outer(layer) for layer in model)
        else:
            callables = tuple(InContext(layer, ctx, sync_fn) for layer in model)

        def step(through: Any, x: torch.Tensor) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            loss = squared_loss(through, leaf)
            loss.backward()
            # (cloned: the parameters' gradients are the backward graphs' static outputs)
            values = [loss.detach(), leaf.grad, *(p.grad for p in model.parameters())]
            return [value.clone() for value in values]

        moved = Moved(live)
        values = step(callables, xs[0])
        found.eager = moved.since(), values
        samples = tuple((torch.zeros(BATCH, W, requires_grad=True),) for _ in range(L))
        graphed = torch.cuda.make_graphed_callables(callables, samples, num_warmup_iters=0)
        for x in xs:
            moved = Moved(live)
            values = step(graphed, x)
            found.replays.append((moved.since(), values))
        found.report = reports.report()
    found.hazards = strict.counters.hazards
    return found


API = ["get_cpu_offload_context", "offload_layers"]


@pytest.mark.parametrize("api", [*API, "offload_layers, a policy with checkpoints"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_whole_step_captured_replays_the_eager_steps_values_and_bytes(flavour, api):
    want = expected()
    found = whole_step(flavour, api)
    assert_values_and_bytes(found, want)
    steps = found.report.cuda_graph
    assert (steps.captured, steps.replay, steps.warmup_steps) == (True, True, 1)
    if api.endswith("checkpoints"):  # the checkpointed layers recompute inside the graph
        assert found.report.recomputed_layers == [0, 1]


@pytest.mark.parametrize("api", API)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_per_layer_graphs_replay_the_eager_steps_values_and_bytes(flavour, api):
    want = expected()
    found = per_layer(flavour, api)
    assert_replays_eager(found, want)


# ------------------------------------------------------------------ planted violations
# Each bug below is planted in the offloader's captured schedule.  A capture that is
# only faked (the backend says it captures, the work runs eagerly: the parity rows of
# test_autograd_parity.py) runs the step as eager does; a real capture in the data
# mode checks CUDA's capture rules, and each replay the strict simulator's.


def faked(plant: Callable[[Any], Any] | None = None, per_layer_callables: bool = False) -> Any:
    """The gradients of a warm-up step and a step with the capture faked, under
    ``strict_streams()`` with ``cuda_graph=True``; and the simulator's hazards."""
    model, xs = layers(), inputs()
    with strict_streams() as sim:
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        through: Any = model
        if per_layer_callables:  # each layer enters the context itself
            through, ctx, sync_fn = [InContext(layer, ctx, sync_fn) for layer in model], None, None
        synchronizer = (ctx or through[0].ctx).offload_synchronizer
        found = []
        for number, x in enumerate(xs[:2]):
            if number == 1:
                synchronizer.backend.wrapped.is_capturing = lambda: True
                if plant is not None:
                    plant(synchronizer)
            model.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            loss = squared_loss(through, leaf, ctx, sync_fn)
            loss.backward()
            found.append([loss.detach(), leaf.grad, *(p.grad for p in model.parameters())])
        del synchronizer.backend.wrapped.is_capturing
    return found, sim.counters.hazards, synchronizer


def test_step_graphs_under_per_layer_capture_fail_at_capture_end_a_faked_capture_passes():
    """``cuda_graph=True`` leaves a layer's offload for the next layer's graph to join:
    the faked capture computes eager's gradients without a hazard, the real per-layer
    capture fails with CUDA's error (never a silent wrong run)."""
    want = expected()
    found, hazards, _ = faked(per_layer_callables=True)
    assert hazards == 0
    for values, wanted in zip(found, want):
        assert_bit_identical(wanted, values)
    with pytest.raises(CaptureError) as raised:
        per_layer("cuda", "get_cpu_offload_context", scope=True)
    assert raised.value.kind == UNJOINED
    assert "never waited for" in str(raised.value)


def joins_dropped(synchronizer: Any) -> None:
    """Plant: the capturing stream never waits for the copy stream (no join)."""
    backend = synchronizer.backend
    wait_event = backend.wait_event

    def wait(stream: Any, event: Any) -> None:
        if stream is synchronizer.offload_stream or not backend.is_capturing():
            wait_event(stream, event)  # the fork stays

    backend.wait_event = wait


def test_a_capture_whose_copies_are_never_joined_fails_at_capture_end():
    with pytest.raises(CaptureError) as raised:
        whole_step("cuda", "get_cpu_offload_context", joins_dropped)
    assert raised.value.kind == UNJOINED


def synchronized_instead(synchronizer: Any) -> None:
    """Plant: the capturing stream's waits for copies are host synchronisations (what a
    manual controller would do); as eager, stronger than a stream wait."""
    backend = synchronizer.backend
    wait_event = backend.wait_event
    synchronizer.host_waits = 0

    def wait(stream: Any, event: Any) -> None:
        if stream is synchronizer.offload_stream or not backend.is_capturing():
            wait_event(stream, event)
        else:
            synchronizer.host_waits += 1
            event.synchronize()

    backend.wait_event = wait


def test_a_host_synchronisation_in_the_schedule_passes_faked_and_fails_captured():
    want = expected()
    found, hazards, synchronizer = faked(synchronized_instead)
    assert hazards == 0 and synchronizer.host_waits > 0  # the plant ran
    for values, wanted in zip(found, want):
        assert_bit_identical(wanted, values)
    with pytest.raises(CaptureError) as raised:
        whole_step("cuda", "get_cpu_offload_context", synchronized_instead)
    # the host waited for an event of the graph; ending the capture (torch.cuda.graph's
    # exit ends it, as torch's does) then finds the copy stream unjoined
    assert raised.value.kind == UNJOINED
    cause = raised.value.__context__
    assert isinstance(cause, CaptureError) and cause.kind == CAPTURED_EVENT
    assert "event.synchronize() of an event recorded in the capture" in str(cause)


def wait_dropped(monkeypatch: Any, which: str) -> None:
    """Plant: while capturing, the wait of the profiler range ``which`` is not made:
    ``"wait_reload"``, a reloaded tensor's first unpack waiting for its copy, or
    ``"release"``, a layer's device tensors dropped after its offload was joined."""
    run_in_range, run_release = layer_state.in_range, transitions.in_range

    def in_range(name: str, label: str, fn: Any, *args: Any) -> Any:
        if name == which == "wait_reload" and fn.__self__.is_capturing():
            return None
        if name == which == "release" and fn.__self__.backend.is_capturing():
            args[0].in_flight = []  # the offload's event, not waited for
        run = run_in_range if name == "wait_reload" else run_release
        return run(name, label, fn, *args)

    monkeypatch.setattr(layer_state, "in_range", in_range)
    monkeypatch.setattr(transitions, "in_range", in_range)


@pytest.mark.parametrize("which", ["release", "wait_reload"])
def test_memory_dropped_under_a_copy_in_flight_is_refused_at_capture_end(monkeypatch, which):
    """Device memory let go of before the capture stream waited for the copy that uses
    it: the graph's pool gives it to later work of the capture (silently wrong on a
    device; in eager, the strict simulator's "freed before the copy ran").  The copy
    is joined later in the step, so CUDA's own rules pass it."""
    wait_dropped(monkeypatch, which)
    with pytest.raises(CaptureError) as raised:
        whole_step("cuda", "get_cpu_offload_context")
    assert raised.value.kind == FREED
    assert "let go of before the capture stream" in str(raised.value)


def test_a_copy_issued_before_its_source_was_computed_is_a_hazard_at_replay():
    """Plant: after the first, the offload stream's waits for the capturing stream
    (the fork before each layer's copies) are not made; the stream is in the capture
    already, so the capture ends, and each replay's strict simulator sees a copy of a
    tensor whose compute it did not wait for."""

    def fork_dropped(synchronizer: Any) -> None:
        backend = synchronizer.backend
        wait_event = backend.wait_event
        forks: list[Any] = []

        def wait(stream: Any, event: Any) -> None:
            if stream is synchronizer.offload_stream and backend.is_capturing():
                forks.append(event)
                if len(forks) > 1:
                    return
            wait_event(stream, event)

        backend.wait_event = wait

    with pytest.raises(StreamHazardError, match="before that stream waited for the compute"):
        whole_step("cuda", "get_cpu_offload_context", fork_dropped)


@pytest.mark.parametrize("captured", ["layers 1 on", "layer 0 only"])
def test_a_pass_split_across_a_captures_boundary_is_refused_with_the_offloaders_error(captured):
    """cuda_graph=True and a forward pass part eager, part in a graph (the first
    layer's forward eager and the rest of the step in the graph, or the first layer
    alone captured): the pass would copy across the capture's boundary.  CUDA refuses
    the first (a wait on an event recorded outside: cudaErrorStreamCaptureIsolation);
    the second it runs, silently: the eager layers copy memory the graph owns, which
    only a replay fills.  The offloader refuses both, naming what to do."""
    model, xs = layers(), inputs()
    x = xs[0].clone().requires_grad_()
    with timed_runtime(DEVICE, data=True) as run:
        live = run.live
        ctx, sync_fn = get_cpu_offload_context(True, K, L, min_offload_numel=0, cuda_graph=True)
        squared_loss(model, x, ctx, sync_fn).backward()  # warm-up
        graph = live.graph(live.CUDAGraph(), stream=live.Stream())
        with pytest.raises(CpuOffloadError) as raised:
            if captured == "layers 1 on":
                with ctx:
                    h = model[0](x)
                h = sync_fn(h)
                with graph:
                    squared_loss(model[1:], h, ctx, sync_fn).backward()
            else:
                with graph, ctx:
                    h = model[0](x)
                squared_loss(model[1:], sync_fn(h), ctx, sync_fn).backward()
    inside = captured == "layers 1 on"
    assert str(raised.value) == capture_changed(1, not inside)
    now = "inside" if inside else "outside"
    assert f"layer 1 of this forward pass entered the offload context {now} a capture" in (
        str(raised.value)
    )
    assert "pass cuda_graph='layer'" in str(raised.value)
