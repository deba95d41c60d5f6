"""The policy chosen for a memory budget from a measured step, applied, and watched:
``offload_layers(model, memory_budget=...)`` (and the integrations' ``memory_budget=``).

NOTE [The automatic policy]
    1. The first forward pass with grad enabled, and its backward, run as the user's
       program (nothing is offloaded or recomputed; gradients are those of the plain
       model) and are measured per layer by the offloader's own rules (NOTE [Measuring a
       step] in measured_step.py): the bytes saved, offloadable and kept (with the
       reasons), the layer's inputs, and its forward time (thread CPU time on a CPU,
       timing events on a device).
    2. When the next pass starts (the first step, optimizer step included, is over;
       with ``"auto"``, once an optimizer step ran: NOTE [When "auto" is read] in
       memory_budget.py), the plan is made: each layer's costs (its measured bytes and
       forward time, its backward assumed :data:`BACKWARD_PER_FORWARD` times its forward), the copy
       bandwidth in each direction (measured once with the backend's copies, or given:
       ``copy_bandwidth=``), the budget (``"auto"`` read now: memory_budget.py), and the
       search over a policy per layer (``PolicySearch.of_layers``, NOTE [Layers that
       differ]).  No layer with checkpoint hazards is ever checkpointed.  The plan is
       applied from this pass on (the synchronizer's schedule, the checkpoint wrappers)
       and one line is printed.  A layer that did not run in the measured step
       (LayerDrop) is planned as the largest measured layer, and never checkpointed,
       until it runs; it is measured then, and the plan is made again (NOTE [What a
       measured pass measures] in planned_synchronizer.py).  A budget that has made no
       plan after :data:`NO_PLAN_WARNING_STEPS` forward passes says why, once.
    3. On a device that reports memory, each step's peak (the most allocated during the
       step, less what was allocated when it started, less the parameters' gradients
       the step may have allocated: the planner counts activations only) is compared
       with the predicted peak (budget_watch.py; the device's peak statistics are never
       reset: NOTE [A step's peak, the user's statistics]).  The first time it exceeds it by
       more than ``REPLAN_MARGIN`` of the budget, a warning says so and the plan is
       made again with that excess (what the event model does not count) taken off
       the budget.
    4. A larger input: layer 0 is observed in every pass; when it saves more than the
       plan was made for, a warning says so, the rest of that pass is measured again
       (the pass itself runs the plan made for the smaller input), and a plan for the
       larger input applies from the next pass.  A checkpointed layer's activations are
       not seen then: its measured bytes are scaled by its inputs'.  A smaller input
       keeps the plan (made for a larger one, it fits).
    5. A step ends when a pass starts after a backward with no pass waiting for its own;
       once more passes were in flight than a plan was made for (a pipeline stage's
       warm-up), it is made again (NOTE [A budget inside a stage] in stage_plan.py).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..device.link import measure_ceiling
from ..device.profiles import DeviceProfile
from ..engine.layer_context import OffloadContext
from ..hooks.selection import warn_once_per_call_site
from ..log import logger
from ..policy.budget_watch import OptimizerWatch, PeakWatch
from ..policy.checkpointing import Checkpointing, checkpoint_forward
from ..policy.measured_step import MeasuredLayer, rescaled
from ..policy.memory_budget import (
    AUTO,
    auto_budget,
    free_device_memory,
    parse_memory_budget,
    said_budget,
    size,
)
from ..policy.model_checkpoints import count_model_checkpoint
from ..policy.planned_synchronizer import PlannedOffloadSynchronizer
from ..policy.policy import CHECKPOINTED, OFFLOADED, checkpoint_hazards
from .policy_plan import PolicyPlan
from .policy_search import PolicySearch
from .schedule_model import measured_costs
from .stage_plan import choose_for_stage

__all__ = ["BACKWARD_PER_FORWARD", "AutoPolicy", "budget_context", "modules_budget_context"]

#: a layer's backward is taken to run this many times as long as its forward (its matrix
#: products' FLOPs: the gradients of the inputs and of the weights)
BACKWARD_PER_FORWARD = 2.0
#: the copy bandwidth is measured with a copy of the largest layer's bytes, within these
LINK_SAMPLE_BYTES = (2**20, 64 * 2**20)
#: why a stack given without its modules is never checkpointed
NO_MODULES = "no module to checkpoint: the layers run in the host library's own loop"
#: forward passes without a plan after which a budget says why it has none, once
NO_PLAN_WARNING_STEPS = 4
#: what a layer that did not run in the measured step cannot be (until it runs)
NOT_MEASURED = "not measured yet (it did not run in the measured step)"
#: why a layer the model checkpoints itself is not checkpointed again (its recompute is
#: counted: NOTE [A checkpoint the model placed] in policy/model_checkpoints.py)
BY_THE_MODEL = "checkpointed by the model already (gradient checkpointing)"
#: the options a planned context takes (those of get_cpu_offload_context that remain)
OPTIONS: tuple[str, ...] = ("retain_pinned_cpu_buffers", "device", "min_offload_numel")
OPTIONS += ("min_offload_bytes", "max_host_bytes")


def announce(line: str) -> None:
    """Say what was chosen, in one line (printed, and logged at ``INFO``)."""
    print(line, flush=True)
    logger.info("%s", line)


def _link(value: object, api: str) -> tuple[float, float] | None:
    """``copy_bandwidth=`` as (device to host, host to device) bytes per second."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        profile = DeviceProfile.from_json(os.fspath(value), flops_per_s=1.0)  # its link only
        return profile.d2h, profile.h2d
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in pair
    ):
        return float(pair[0]), float(pair[1])
    raise ValueError(
        f"{api}: copy_bandwidth must be bytes per second > 0 (one number, or a pair: device "
        "to host, host to device) or the JSON file of `python -m cpu_offload.check --json`; "
        f"got {value!r}."
    )


class AutoPolicy:
    """Measures a step, chooses a policy per layer for the budget, applies it, and
    watches it (NOTE [The automatic policy]).

    Attributes:
        plan: the :class:`~cpu_offload.plan.PolicyPlan` in force; None until the
            measuring step is over.
        measured: what each layer saved in the measured step (the plan's source; see
            :func:`~cpu_offload.policy.measured_step.census_report`); None until its forward
            ends.
        link: the copy bandwidth (device to host, host to device), bytes per second.
        measured_peak: on a device that reports memory, the last step's peak of
            activations (allocated above what was allocated when it started, less the
            gradients the step may have allocated).
        synchronizer: the synchronizer it schedules.
    """

    synchronizer: PlannedOffloadSynchronizer

    def __init__(
        self,
        memory_budget: object,
        num_layers: int,
        *,
        api: str,
        layers: Sequence[nn.Module] | None = None,
        parameters: Sequence[torch.Tensor] = (),
        copy_bandwidth: object = None,
    ) -> None:
        self.api = api
        self.memory_budget = parse_memory_budget(memory_budget, api)
        self.link = _link(copy_bandwidth, api)
        self.layers = list(layers) if layers is not None else None
        self.parameters = list(parameters)
        self.plan: PolicyPlan | None = None
        self.measured: list[MeasuredLayer | None] | None = None
        self.enabled: Callable[[], bool] = lambda: True
        self._pending: list[MeasuredLayer | None] | None = None
        self._passes_unplanned = 0
        self._said_no_plan = False
        #: with "auto": whether an optimizer of these parameters has stepped
        self.optimizer = OptimizerWatch(self.parameters) if self.memory_budget == AUTO else None
        self.peak = PeakWatch(api, self.parameters)
        self._checkpointing: list[Checkpointing] = []
        self._planned: set[int] = set()  # the modules the plan checkpoints
        self._warned: set[str] = set()
        self._hooks: list[RemovableHandle] = []
        self._restores: list[Callable[[], None]] = []  # model_checkpoints.py
        self.in_flight = 1  #: the most forward passes in flight at once (step_starts)
        if self.layers is None:
            self.hazards = [[NO_MODULES]] * num_layers
            self.modules: list[int] | None = None
            self.names: list[str] = []
        else:
            found: dict[int, list[str]] = {}
            self.hazards = [found.setdefault(id(m), checkpoint_hazards(m)) for m in self.layers]
            self.modules = [id(m) for m in self.layers]
            self.names = [type(m).__name__ for m in self.layers]

    # ------------------------------------------------------------ the layers

    def attach(self, enabled: Callable[[], bool]) -> None:
        """Watch the layers' inputs (what a checkpoint of each would save), and wrap the
        layers that may be checkpointed; checkpoint only while ``enabled()``.  Call after
        the offload hooks are installed (this pre-hook runs after theirs, inside the
        layer's context).

        A plan is made in layer 0's pre-hook, after the module call has looked up its
        ``forward``: so every layer without hazards gets its checkpoint wrapper now,
        passing through until a plan checkpoints it.
        """
        self.enabled = enabled
        layers = self.layers or []
        unique = {id(m): (position, m) for position, m in reversed(list(enumerate(layers)))}
        hook = torch.compiler.disable(self._note_inputs)
        for key, (position, module) in unique.items():
            self._hooks.append(module.register_forward_pre_hook(hook))
            if not self.hazards[position]:
                wanted = functools.partial(self._checkpoints, key)
                at = [j for j, m in enumerate(layers) if m is module]
                noted = functools.partial(self.synchronizer.note_recompute, *at)
                self._checkpointing.append(
                    checkpoint_forward(module, wanted, position, self._warned, noted)
                )

    @property
    def policy(self) -> list[str] | None:
        """The plan's policy in force; None while the first step is measured."""
        return list(self.plan.policy) if self.plan is not None else None

    def _checkpoints(self, module: int) -> bool:
        return module in self._planned and self.enabled()

    def _note_inputs(self, module: nn.Module, args: Any) -> None:
        if self.enabled():
            self.synchronizer.note_inputs([a for a in args if isinstance(a, torch.Tensor)])
            restore = count_model_checkpoint(module, self.synchronizer.checkpointed)
            if restore is not None:  # NOTE [A checkpoint the model placed]
                self._restores.append(restore)

    def remove(self) -> None:
        """Remove the input hooks, the checkpoint wrappers and the optimizer hook."""
        if self.optimizer is not None:
            self.optimizer.remove()
        for removables in (self._hooks, self._checkpointing):
            for removable in removables:
                removable.remove()
            removables.clear()
        for restore in self._restores:
            restore()
        self._restores.clear()

    # ---------------------------------------------------- what the step says

    measured_peak = property(lambda self: self.peak.measured_peak)

    sample_memory = lambda self, backward: self.peak.sample(self.synchronizer.backend, backward)

    def step_starts(self) -> None:
        backend, plan = self.synchronizer.backend, self.plan
        waiting = len(self.synchronizer.waiting_passes())  # NOTE [A budget inside a stage]
        self.in_flight = max(self.in_flight, waiting + 1)
        over = not waiting and self.synchronizer.recorder.steps > 0  # a step: a backward
        if plan is not None and over:
            watch = self._pending is None
            if self.peak.over(backend, plan.predicted.peak_bytes, plan.memory_budget, watch):
                self._pending = self.measured
            elif self.in_flight > plan.in_flight:  # more passes in flight than planned for
                self._pending = self._pending or self.measured
        if over and self._pending is not None and (not self.optimizer or self.optimizer.stepped):
            self._make_plan()
        if self.plan is None and not waiting:  # a stage's warm-up is one step
            self._passes_unplanned += 1
            if self._passes_unplanned > NO_PLAN_WARNING_STEPS and not self._said_no_plan:
                self._said_no_plan = True
                warn_once_per_call_site(
                    f"cpu_offload: {self.api}(memory_budget=...): no plan after "
                    f"{NO_PLAN_WARNING_STEPS} forward passes, so nothing is offloaded or "
                    f"checkpointed: {self.why_no_plan or 'no forward ran under the hooks'}. "
                    "This warning is shown once."
                )
        if not waiting:  # peaks are per step
            self.peak.start(backend, self.plan is not None)

    @property
    def why_no_plan(self) -> str:
        """Why no plan is in force (while none is); empty while the first step is measured."""
        if self._pending is not None:
            return (
                "memory_budget='auto' is read after the first optimizer step (its state "
                "allocated), and no step of a torch.optim optimizer of these parameters "
                "ran yet (give the budget in bytes, such as '20GiB', for another optimizer)"
            )
        return self.synchronizer.why_unmeasured

    def forward_measured(self, layers: list[MeasuredLayer | None]) -> None:
        if self.measured is not None and self.plan is not None:
            checkpointed = [c in CHECKPOINTED for c in self.plan.policy]
            layers = rescaled(layers, self.measured, checkpointed)
        self.measured = self._pending = layers

    def layer_measured(self, layer: int, record: MeasuredLayer) -> None:
        if self.measured is not None:
            found = self.measured
            self.measured = self._pending = [*found[:layer], record, *found[layer + 1 :]]
        warn_once_per_call_site(
            f"cpu_offload: {self.api}(memory_budget=...): layer {layer}, which did not run "
            f"in the measured step (LayerDrop, a skipped block), ran now and saved "
            f"{size(record.saved_bytes)}; it was planned as the largest measured layer, and "
            "the plan is made again from the next step with what it saved."
        )

    def first_layer(self, layer: MeasuredLayer) -> bool:
        plan, measured = self.plan, self.measured
        if plan is None or measured is None or self._pending is not None:
            return False
        first = measured[0]
        if first is None:
            return False
        expected = first.input_bytes if plan.policy[0] in CHECKPOINTED else first.saved_bytes
        if layer.saved_bytes <= expected:
            return False
        warn_once_per_call_site(
            f"cpu_offload: {self.api}(memory_budget=...): layer 0 saved "
            f"{size(layer.saved_bytes)}, more than the {size(expected)} the plan was made "
            "for (a larger input: another sequence length or batch size). This step runs "
            "that plan and measures the layers again; a plan for the larger input applies "
            "from the next step."
        )
        return True

    # ------------------------------------------------------------- the plan

    def budget(self) -> int:
        """The budget in bytes now (``"auto"`` read now), less what a measured step
        showed the plan does not count (once it exceeded its prediction)."""
        if self.memory_budget == AUTO:
            total = auto_budget(self.synchronizer.backend, self.parameters)
        else:
            total = int(self.memory_budget)
        return max(0, total - self.peak.excess)

    def _make_plan(self) -> None:
        found, self._pending = self._pending or [], None
        ran = [r for r in found if r is not None]
        stand_in = max(ran, key=lambda r: r.saved_bytes)
        records = [r if r is not None else stand_in for r in found]
        hazards = [h + [NOT_MEASURED] if r is None else h for h, r in zip(self.hazards, found)]
        hazards = [
            h + [BY_THE_MODEL] if r and r.by_the_model else h for h, r in zip(hazards, found)
        ]
        costs = measured_costs(records, BACKWARD_PER_FORWARD)
        if self.link is None:
            largest = max([r.offloaded_bytes for r in records] + [0])
            sample = min(max(largest, LINK_SAMPLE_BYTES[0]), LINK_SAMPLE_BYTES[1])
            measured = measure_ceiling(self.synchronizer.backend, sample, repeats=3)
            self.link = measured["d2h"], measured["h2d"]
        search = PolicySearch.of_layers(
            costs, *self.link, hazards=hazards, modules=self.modules, names=self.names
        )
        host_cap = self.synchronizer.host_buffers.max_bytes
        self._apply(choose_for_stage(search, self.budget(), host_cap, self.in_flight))
        missing = [j for j, r in enumerate(found) if r is None]
        if missing:
            warn_once_per_call_site(
                f"cpu_offload: {self.api}(memory_budget=...): layers {missing} did not run "
                "in the measured step (LayerDrop, a skipped block): each is planned as the "
                f"largest measured layer ({size(stand_in.saved_bytes)}) and not "
                "checkpointed until it runs; it is measured then, and the plan is made again."
            )

    def _apply(self, plan: PolicyPlan) -> None:
        self.plan = plan
        self.synchronizer.schedule([j for j, c in enumerate(plan.policy) if c in OFFLOADED])
        self.synchronizer.set_keep_passes(plan.keep_passes)
        self._checkpoint(plan.policy)
        said = said_budget(self.memory_budget)
        announce(f"cpu_offload: {self.api}(memory_budget={said}): {plan.line()}")
        if not plan.fits:
            warn_once_per_call_site(
                f"cpu_offload: {self.api}: no policy fits the memory budget of "
                f"{size(plan.memory_budget)} (the limit that binds: {plan.binding}); the "
                f"closest is applied ({plan.runs()}). "
                f"{plan.why}"
            )

    def _checkpoint(self, policy: list[str]) -> None:
        """Checkpoint the modules ``policy`` checkpoints, and no other (wrapped: attach)."""
        layers = self.layers or []
        self._planned = {id(layers[j]) for j, c in enumerate(policy) if c in CHECKPOINTED}


def budget_context(
    num_layers: int,
    memory_budget: object,
    *,
    api: str,
    layers: Sequence[nn.Module] | None = None,
    parameters: Sequence[torch.Tensor] = (),
    excluded: frozenset[int] = frozenset(),
    copy_bandwidth: object = None,
    **options: Any,
) -> tuple[OffloadContext, AutoPolicy]:
    """An offload context whose policy is chosen for ``memory_budget`` from its first
    measured step, and the :class:`AutoPolicy` that chooses it.

    Args:
        num_layers: layers per forward pass.
        memory_budget: bytes, a size string (``"20GiB"``), or ``"auto"``.
        api: the caller's name, for messages.
        layers: the modules (for checkpointing and their hazards); None: the layers
            are never checkpointed.
        parameters: the model's parameters (``"auto"`` counts the gradients to come).
        excluded: storages of the model's parameters and buffers.
        copy_bandwidth: bytes per second (one, or a pair), or a check JSON; None:
            measured once.
        **options: ``retain_pinned_cpu_buffers``, ``device``, ``min_offload_numel``,
            ``min_offload_bytes``, ``max_host_bytes``.
    """
    for name in options:
        if name not in OPTIONS:
            raise TypeError(
                f"{api}: memory_budget= chooses the layers to offload and schedules them "
                f"itself; {name}= does not combine with it (options: {', '.join(OPTIONS)}, "
                "copy_bandwidth)."
            )
    auto = AutoPolicy(
        memory_budget,
        num_layers,
        api=api,
        layers=layers,
        parameters=parameters,
        copy_bandwidth=copy_bandwidth,
    )
    synchronizer = PlannedOffloadSynchronizer(num_layers, auto, excluded=excluded, **options)
    auto.synchronizer = synchronizer
    if auto.memory_budget == AUTO and free_device_memory(synchronizer.backend) is None:
        raise ValueError(
            f"{api}: memory_budget='auto' needs the device's free memory, which its runtime "
            f"({synchronizer.backend.device}) does not report; give a number of bytes or a "
            "string such as '20GiB'."
        )
    return OffloadContext(synchronizer), auto


def modules_budget_context(
    model: nn.Module | Sequence[nn.Module],
    layers: Sequence[nn.Module],
    memory_budget: object,
    **options: Any,
) -> tuple[OffloadContext, AutoPolicy]:
    """:func:`budget_context` for ``offload_layers(model, memory_budget=...)``: the
    layers checkpointable, the model's parameters and buffers set apart."""
    modules = ([model] if isinstance(model, nn.Module) else []) + list(layers)
    parameters = list({id(p): p for m in modules for p in m.parameters()}.values())
    buffers = [b for m in modules for b in m.buffers()]
    return budget_context(
        len(layers),
        memory_budget,
        api="offload_layers",
        layers=layers,
        parameters=parameters,
        excluded=frozenset(t.untyped_storage()._cdata for t in parameters + buffers),
        **options,
    )
