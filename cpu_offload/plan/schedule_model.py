"""An event model of the default schedule, and the plan it gives for every k.

Two clocks, as on the device: the compute stream runs each layer's forward and backward
(FLOPs over the profile's rate); the offload stream runs the copies one after another at
the link's bandwidth.  The model takes the steps of :class:`DefaultOffloadSynchronizer`
where the code takes them:

- forward of layer ``j``: the offload of layer ``j - 1`` starts (after the compute stream
  reached this point); layer ``i`` is released when ``j == L - k + i``, and the release
  makes the compute stream wait for that copy;
- backward of layer ``j``: the layer above is released; the reload of layer ``i`` starts
  when ``j == L - 1 - k + i`` (after the compute stream reached this point; its device
  memory is allocated then); layer ``j``'s first pop makes the compute stream wait for
  its reload;
- end of backward: the last layer is released.

Every time it gives is a prediction.  Memory is the layers' saved activations only
(parameters, gradients and optimizer state come on top).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..device.profiles import DeviceProfile
from ..engine.reload_slices import slice_sources
from ..engine.schedule import schedule_points
from ..policy.policy import (
    CHECKPOINTED,
    KEEP,
    OFFLOAD,
    OFFLOADED,
)
from .census import LayerProfile

__all__ = ["LayerCosts", "PlanRow", "first_k", "layer_costs", "simulate", "simulate_policy"]
__all__ += ["Pop", "measured_costs", "policy_bytes", "slice_sizes", "sliced_backward"]


@dataclass
class PlanRow:
    """The prediction for one policy of a stack, such as offloading its first k layers
    (times in seconds, memory in bytes).

    Attributes:
        offloaded_layers: how many layers the policy offloads (``k`` in the table of
            every k, where it offloads the first k; see :attr:`k`).
        end_of_forward_bytes: saved activations on the device when the forward ends.
        peak_bytes: the most saved activations on the device at any step.
        offloaded_bytes: bytes copied to the host per step (and back).
        exposed_copy_s: time the compute stream waits for copies.
        step_s: forward plus backward, waits and recomputation included.
        overhead: ``step_s`` over the step without offload, minus one.
        log: ``(step, action, activations on the device after it)`` per step.
        recompute_s: time spent running checkpointed layers' forwards again.
    """

    offloaded_layers: int
    end_of_forward_bytes: int
    peak_bytes: int
    offloaded_bytes: int
    exposed_copy_s: float
    step_s: float
    overhead: float
    log: list[tuple[str, str, int]] = field(default_factory=list, repr=False)
    recompute_s: float = 0.0

    @property
    def k(self) -> int:
        """The row's k, in the table of every k (``plan_offload``): its offloaded layers."""
        return self.offloaded_layers


@dataclass(frozen=True)
class LayerCosts:
    """What the event model needs of one layer (bytes, and seconds on the device).

    Attributes:
        saved_bytes, offloaded_bytes, kept_bytes: as in :class:`LayerProfile`.
        input_bytes: what a checkpointed layer keeps saved: its inputs.
        input_offloaded_bytes: what of those a checkpointed, offloaded layer copies.
        forward_s, backward_s: the layer's compute time.
        following: the costs of the layers after the first, where they differ (their
            input is the previous layer's output; NOTE [The layers after the first]).
        recompute_s: a checkpointed layer's recomputation in backward; its whole
            forward where None (:attr:`recompute`).
        gradient_bytes: the parameter gradients the layer's backward allocates, counted
            from the boundary below it to the step's end where given (the peak of a
            step whose gradients are allocated by its backward); 0: left out (the
            budget's gradients are allocated before the step: memory_budget.py).
        unpacks: per offloaded storage in pack order, its bytes, the backward's
            seconds before its first unpack and that unpack's rank
            (``LayerProfile.offloaded_unpacks``); empty: a sliced backward's compute
            split by bytes (NOTE [Timing the slices of a reload]).
        recompute_bytes: what a checkpoint the model placed in the layer holds during
            the layer's backward, on top of what it saved (its recompute's activations:
            NOTE [A checkpoint the model placed] in policy/model_checkpoints.py); the
            policy does not checkpoint such a layer again.
    """

    saved_bytes: int
    offloaded_bytes: int
    kept_bytes: int
    forward_s: float
    backward_s: float
    input_bytes: int = 0
    input_offloaded_bytes: int = 0
    following: LayerCosts | None = None
    recompute_s: float | None = None
    gradient_bytes: int = 0
    unpacks: tuple[tuple[int, float, int], ...] = ()
    recompute_bytes: int = 0

    def by_model(self, choice: str) -> int:
        """What the layer's backward holds for a checkpoint the model placed in it, under
        ``choice`` (nothing where the policy checkpoints it: :attr:`recompute_bytes`)."""
        return 0 if choice in CHECKPOINTED else self.recompute_bytes

    @property
    def recompute(self) -> float:
        """Seconds a checkpointed layer spends recomputing in backward."""
        return self.forward_s if self.recompute_s is None else self.recompute_s

    @classmethod
    def of(cls, layer: LayerProfile, device: DeviceProfile) -> LayerCosts:
        return cls(
            saved_bytes=layer.saved_bytes,
            offloaded_bytes=layer.offloaded_bytes,
            kept_bytes=layer.kept_bytes,
            forward_s=device.compute_seconds(layer.forward_flops, layer.forward_kernels),
            backward_s=device.compute_seconds(layer.backward_flops, layer.backward_kernels),
            input_bytes=layer.input_bytes,
            input_offloaded_bytes=layer.input_offloaded_bytes,
            following=None if layer.following is None else cls.of(layer.following, device),
            recompute_s=device.compute_seconds(
                sum(f for f, _ in layer.recompute_kernels), layer.recompute_kernels
            )
            if layer.recompute_kernels
            else None,
            unpacks=unpack_seconds(layer, device),
        )

    def slices(self, slice_bytes: int | None, prefetch: bool = True) -> tuple[list[int], list[Pop]]:
        """The slices an offloaded layer is reloaded in, in backward order, and the
        steps of its backward (NOTE [Timing the slices of a reload]); ``prefetch``:
        False, each slice is issued by its first pop (NOTE [Slices at the peak] in
        engine/reload_slices.py)."""
        moved = self.offloaded_bytes
        ahead = 1 if prefetch else 0
        if not self.unpacks or slice_bytes is None or moved <= slice_bytes:
            sizes = slice_sizes(moved, slice_bytes)
            seconds = [self.backward_s * n / moved if moved else 0.0 for n in sizes]
            pops = []
            for s in range(len(sizes)):
                issues: tuple[int, ...] = (s + ahead,) if 0 < s + ahead < len(sizes) else ()
                pops.append(Pop(seconds[s - 1] if s else 0.0, issues, s))
            return sizes, pops + [Pop(seconds[-1], (), -1)]
        sources = slice_sources([n for n, _, _ in self.unpacks], slice_bytes)
        sizes = [sum(self.unpacks[i][0] for i in slice) for slice in sources]
        firsts = sorted(
            (min(self.unpacks[i][1:] for i in slice), number)
            for number, slice in enumerate(sources)
        )
        issued, pops, before = {0}, [], 0.0
        for (at, _), number in firsts:  # a pop issues its slice and the next, if not yet
            wanted = (number, number + ahead)
            issues = tuple(sorted({s for s in wanted if s < len(sizes) and s not in issued}))
            issued.update(issues)
            pops.append(Pop(max(at - before, 0.0), issues, number))
            before = max(at, before)
        return sizes, pops + [Pop(max(self.backward_s - before, 0.0), (), -1)]

    def per_layer(self, num_layers: int) -> list[LayerCosts]:
        """The costs of each layer of a stack of ``num_layers``."""
        return [self] + [self.following or self] * (num_layers - 1)


class Pop(NamedTuple):
    """A step of a sliced backward (NOTE [Timing the slices of a reload]): ``after``
    seconds of compute, then the pop that first takes from slice ``wait`` issues the
    slices ``issues`` and waits for ``wait``'s copies (-1: the backward's end)."""

    after: float
    issues: tuple[int, ...]
    wait: int


# NOTE [Timing the slices of a reload]
# A layer reloaded in slices (NOTE [Reloading a layer in slices] in
# engine/reload_slices.py) waits where a pop takes from a slice whose copy is not done,
# and a slice's copy starts at the first pop of the slice before it.  So what decides
# the waits is when the backward first takes from each slice, not the slice's bytes: an
# elementwise node can consume a 224 MiB slice in a fraction of the copy of the next,
# and nodes may take from a later slice before an earlier one (issued at once, on
# demand, behind the copies already queued).  The census records, per offloaded
# storage, how many backward kernels ran before its first unpack, and the rank of that
# unpack (``LayerProfile.offloaded_unpacks``); ``LayerCosts.unpacks`` times them as the
# backward's kernels are timed; ``LayerCosts.slices`` cuts the storages into slices as
# the engine does (``slice_sources``) and lists the pops in backward order: the compute
# between them, the slices each issues, the slice each waits for.  Without the census
# (costs given by hand), the compute is split over the slices by their bytes, each
# slice first taken in turn.


def unpack_seconds(
    layer: LayerProfile, device: DeviceProfile
) -> tuple[tuple[int, float, int], ...]:
    """:attr:`LayerCosts.unpacks` of a census on ``device``: the backward's kernels
    before each first unpack, timed as the whole backward is."""
    kernels = layer.backward_kernels
    if not layer.offloaded_unpacks or not kernels:
        return ()
    total = device.compute_seconds(layer.backward_flops, kernels)
    each = [device.compute_seconds(f, [(f, b)]) for f, b in kernels]
    before = np.concatenate([[0.0], np.cumsum(each)])
    scale = total / before[-1] if before[-1] > 0 else 0.0
    return tuple((n, float(before[at]) * scale, rank) for n, at, rank in layer.offloaded_unpacks)


def layer_costs(costs: LayerCosts | Sequence[LayerCosts], num_layers: int) -> list[LayerCosts]:
    """One :class:`LayerCosts` per layer of a stack of ``num_layers``: a profile's
    :meth:`LayerCosts.per_layer`, or a list with one entry per layer as it is (layers
    that differ: dense and mixture-of-experts layers, the first and the last, hybrids)."""
    if isinstance(costs, LayerCosts):
        return costs.per_layer(num_layers)
    each = list(costs)
    if len(each) != num_layers:
        raise ValueError(
            f"simulate_policy: {len(each)} layer costs for a policy of {num_layers} layers; "
            "give one LayerCosts per layer, or one for all of them."
        )
    return each


def measured_costs(records: Sequence[Any], backward_per_forward: float) -> list[LayerCosts]:
    """Each measured layer's costs (a ``MeasuredLayer`` of ``policy/measured_step.py``:
    its bytes and forward time); a layer whose forward was not timed takes the mean of
    those that were, and a backward is ``backward_per_forward`` times its forward."""
    timed = [r.forward_s for r in records if r.forward_s is not None]
    fill = sum(timed) / len(timed) if timed else 0.0
    costs = []
    for record in records:
        forward = record.forward_s if record.forward_s is not None else fill
        costs.append(
            LayerCosts(
                record.saved_bytes,
                record.offloaded_bytes,
                record.kept_bytes,
                forward,
                backward_per_forward * forward,
                record.input_bytes,
                record.input_offloaded_bytes,
                recompute_bytes=record.recompute_bytes,
            )
        )
    return costs


def simulate(
    num_layers: int,
    k: int,
    *,
    saved_bytes: int,
    offloaded_bytes: int,
    kept_bytes: int,
    forward_s: float,
    backward_s: float,
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
) -> PlanRow:
    """Run the default schedule of ``k`` of ``num_layers`` identical layers."""
    if not 0 <= k <= num_layers - 1:
        raise ValueError(f"simulate: k must be in [0, {num_layers - 1}], got {k}.")
    costs = LayerCosts(saved_bytes, offloaded_bytes, kept_bytes, forward_s, backward_s)
    return simulate_policy(first_k(num_layers, k), costs, d2h_bytes_per_s, h2d_bytes_per_s)


def first_k(num_layers: int, k: int) -> list[str]:
    """The policy of the default schedule with ``k`` layers offloaded."""
    return [OFFLOAD] * k + [KEEP] * (num_layers - k)


def slice_sizes(moved: int, slice_bytes: int | None) -> list[int]:
    """The slices a layer that moves ``moved`` bytes is reloaded in (NOTE [Reloading a
    layer in slices] in engine/reload_slices.py), in backward order: ``slice_bytes``
    each, the rest last; one slice, the whole layer, where it fits one (or None)."""
    if slice_bytes is None or moved <= slice_bytes:
        return [moved]
    count = -(-moved // slice_bytes)
    return [slice_bytes] * (count - 1) + [moved - slice_bytes * (count - 1)]


def policy_bytes(
    policy: Sequence[str], costs: LayerCosts | Sequence[LayerCosts], slice_bytes: int | None
) -> tuple[list[LayerCosts], list[int], list[int], list[list[int]]]:
    """Per layer of ``policy``: its costs, the bytes it keeps saved through the forward,
    the bytes it moves, and the slices it is reloaded in (its moved bytes whole, but for
    an offloaded layer with ``slice_bytes``)."""
    each = layer_costs(costs, len(policy))
    saved = [
        each[j].saved_bytes if c not in CHECKPOINTED else each[j].input_bytes
        for j, c in enumerate(policy)
    ]
    moved = [
        each[j].offloaded_bytes if c == OFFLOAD else each[j].input_offloaded_bytes
        for j, c in enumerate(policy)
    ]
    slices = [
        each[j].slices(slice_bytes)[0] if c == OFFLOAD else [n]
        for j, (c, n) in enumerate(zip(policy, moved))
    ]
    return each, saved, moved, slices


def sliced_backward(
    compute: float, copies: float, sizes: list[int], pops: list[Pop], h2d_bytes_per_s: float
) -> tuple[float, float, float]:
    """The backward of a layer reloaded in slices of ``sizes`` (NOTE [Reloading a layer
    in slices] in engine/reload_slices.py), its first slice there, run through ``pops``
    (:meth:`LayerCosts.slices`): a pop issues its slices behind the copies queued and
    after the compute so far, and the compute stream waits for a slice not there yet.
    Its memory is the first two slices and what stays.  Returns the compute stream's and
    the copies' clocks after it, and the time the compute stream waited."""
    done, waited = [compute] + [0.0] * (len(sizes) - 1), 0.0
    for pop in pops:
        compute += pop.after
        for number in pop.issues:
            copies = done[number] = max(copies, compute) + sizes[number] / h2d_bytes_per_s
        if pop.wait >= 0 and done[pop.wait] > compute:
            waited += done[pop.wait] - compute
            compute = done[pop.wait]
    return compute, copies, waited


def simulate_policy(
    policy: Sequence[str],
    costs: LayerCosts | Sequence[LayerCosts],
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
    *,
    log: bool = True,
    reload_slice_bytes: int | None = None,
    on_demand: Sequence[int] = (),
) -> PlanRow:
    """Run the default schedule with a per-layer policy (see :mod:`cpu_offload.policy.policy`):
    the offloaded layers (``offload``, ``checkpoint+offload``) are released and reloaded
    as :class:`~cpu_offload.DefaultOffloadSynchronizer` schedules its ``offloaded_layers``;
    a checkpointed layer keeps its inputs saved and runs its forward again in backward,
    where its saved activations are back on the device until the layer below runs.
    ``costs`` is one layer's, for a stack of layers alike, or a list of one per layer;
    ``reload_slice_bytes``: offloaded layers reloaded in slices (:func:`sliced_backward`),
    those of ``on_demand`` without prefetch (they hold one slice, not two)."""
    L = len(policy)
    offloaded = [j for j, choice in enumerate(policy) if choice in OFFLOADED]
    m = len(offloaded)
    points = schedule_points(L, offloaded)
    release_at = {layer: release for layer, (release, _) in points.items()}
    released_at = {release: layer for layer, (release, _) in points.items()}
    reloaded_at = {reload: layer for layer, (_, reload) in points.items()}
    each, saved, moved, slices = policy_bytes(policy, costs, reload_slice_bytes)
    compute = copies = waited = 0.0
    resident = [0] * L  # each layer's saved bytes on the device
    total = 0  # their sum
    copy_done: dict[int, float] = {}
    reload_done: dict[int, float] = {}
    steps: list[tuple[str, str, int]] = []
    peak = 0

    def wait_for(done: float) -> None:
        nonlocal compute, waited
        if done > compute:
            waited += done - compute
            compute = done

    def hold(layer: int, nbytes: int) -> None:
        nonlocal total
        total += nbytes - resident[layer]
        resident[layer] = nbytes

    def note(step: str, actions: list[str]) -> None:
        nonlocal peak
        peak = max(peak, total)
        if log:
            steps.append((step, "; ".join(actions) or "-", total))

    for j in range(L):
        actions = []
        if j >= 1 and j - 1 in release_at:
            start = max(copies, compute)
            copies = copy_done[j - 1] = start + moved[j - 1] / d2h_bytes_per_s
            actions.append(f"start offload {j - 1}")
        if j in released_at:
            i = released_at[j]
            wait_for(copy_done[i])
            hold(i, saved[i] - moved[i])
            actions.append(f"release {i}")
        compute += each[j].forward_s
        hold(j, saved[j])
        note(f"fwd {j}", actions)
    end_of_forward = total
    recompute = 0.0
    for j in reversed(range(L)):
        actions = []
        if j + 1 < L:
            hold(j + 1, 0)
            total += each[j + 1].gradient_bytes
            actions.append(f"release {j + 1}")
        if j in reloaded_at:
            i = reloaded_at[j]
            start = max(copies, compute)
            copies = reload_done[i] = start + slices[i][0] / h2d_bytes_per_s
            hold(i, resident[i] + slices[i][0])
            actions.append(f"start reload {i}")
        if j in release_at:
            wait_for(reload_done[j])
        if policy[j] in CHECKPOINTED:
            compute += each[j].recompute
            recompute += each[j].recompute
            hold(j, each[j].saved_bytes)
            actions.append(f"recompute {j}")
        prefetch = j not in on_demand  # on demand: the slice in use, not the next too
        hold(j, resident[j] + sum(slices[j][1:2]) * prefetch + each[j].by_model(policy[j]))
        whole = [Pop(each[j].backward_s, (), -1)]  # reloaded whole, or not offloaded
        pops = each[j].slices(reload_slice_bytes, prefetch)[1] if len(slices[j]) > 1 else whole
        compute, copies, wait = sliced_backward(compute, copies, slices[j], pops, h2d_bytes_per_s)
        waited += wait
        note(f"bwd {j}", actions)
    hold(0, 0)
    total += each[0].gradient_bytes
    note("end", ["release 0"])
    baseline = sum(c.forward_s + c.backward_s for c in each)
    return PlanRow(
        offloaded_layers=m,
        end_of_forward_bytes=end_of_forward,
        peak_bytes=peak,
        offloaded_bytes=sum(moved[j] for j in offloaded),
        exposed_copy_s=waited,
        step_s=compute,  # the compute stream's clock, without rounding
        overhead=(waited + recompute) / baseline if baseline > 0 else 0.0,
        log=steps,
        recompute_s=recompute,
    )
