"""What a memory budget's policy watches between steps: the first optimizer step (when
``"auto"`` may be read: NOTE [When "auto" is read] in memory_budget.py) and each step's
peak of activations against the plan's prediction (NOTE [The automatic policy], 3).

NOTE [A step's peak, the user's statistics]
    The device's peak statistic (``torch.cuda.max_memory_allocated()``) is the user's:
    it says whether the budget cured an out-of-memory error over the whole run, so the
    watch never resets it.  A step's peak is read from it when the step raised it (the
    statistic at the step's end is above what it was at its start: the step's peak is
    then the statistic itself, exactly).  Otherwise an earlier moment holds the record
    (the measured step, which keeps everything, or a larger input), and the step's peak
    is the most allocated at the points the watch samples: each layer's forward end and
    each layer's backward start (``PlannedOffloadSynchronizer``), less the gradients
    allocated by then.  That is a lower bound: a temporary that lives only inside a
    layer's forward or backward (a checkpointed layer's recompute among them) is not
    seen.  The statistic is read when the next step starts: a reset made before then (a
    training loop that resets before each step) leaves the sampled bound.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from ..device.backend import DeviceBackend
from ..hooks.selection import warn_once_per_call_site
from .memory_budget import REPLAN_MARGIN, size

__all__ = ["OptimizerWatch", "PeakWatch"]


class OptimizerWatch:
    """Whether an optimizer of ``parameters`` (any optimizer, when none are given) has
    stepped since the watch started; the global hook is removed at its first step, by
    :meth:`remove`, or when the watch is collected.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> watch = OptimizerWatch([w])
        >>> w.grad = torch.ones(2)
        >>> torch.optim.SGD([w], lr=0.1).step()
        >>> watch.stepped
        True
    """

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self.stepped = False
        ours = {id(p) for p in parameters}
        me = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, *args: Any) -> None:
            watch = me()
            if watch is None or watch.stepped:
                return
            groups = optimizer.param_groups
            if ours and not any(id(p) in ours for g in groups for p in g["params"]):
                return  # another model's optimizer
            watch.stepped = True
            watch.remove()

        self._hook: RemovableHandle | None = register_optimizer_step_post_hook(hook)
        weakref.finalize(self, self._hook.remove)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class PeakWatch:
    """A step's peak of activations on a device that reports memory: the most allocated
    during the step, less what was allocated when it started, less the gradients the
    step may have allocated (of the parameters that held none when it started), so that
    it is the quantity the planner predicts (activations only).

    It never resets the device's peak statistics (NOTE [A step's peak, the user's
    statistics]).

    Attributes:
        measured_peak: the last step's peak of activations, as above (None: not known).
        exact: whether :attr:`measured_peak` is the device's own peak (the step raised
            it), rather than the most allocated at the layer boundaries sampled.
        excess: what the one step over its prediction exceeded it by (0 until then).
    """

    def __init__(self, api: str, parameters: Sequence[torch.Tensor]) -> None:
        self.api = api
        self.parameters = parameters
        self.measured_peak: int | None = None
        self.exact = False
        self.excess = 0
        self._floor: int | None = None
        self._record = 0  # the device's peak statistic when the step started
        self._sampled = 0  # the most allocated at the sampled points of the step
        self._gradients = 0  # of the parameters that held none when the step started
        self._to_come: list[torch.Tensor] = []  # those of them that still hold none
        self._come = 0  # the bytes of the others (allocated since)
        self._fired = False

    def start(self, backend: DeviceBackend, planned: bool) -> None:
        """A step starts (under a plan when ``planned``)."""
        allocated = backend.memory_allocated() if planned else None
        self._floor = allocated
        if allocated is not None:
            self._record = backend.max_memory_allocated() or 0
            self._sampled = allocated
            self._to_come = [p for p in self.parameters if p.requires_grad and p.grad is None]
            self._gradients = self._come = 0
            for p in self._to_come:
                self._gradients += p.numel() * p.element_size()

    def sample(self, backend: DeviceBackend, backward: bool) -> None:
        """Note what is allocated now (a layer's forward ended, or backward reached a
        layer), less the gradients allocated since the step started."""
        if self._floor is None:
            return
        if backward and self._to_come:
            grown = [p for p in self._to_come if p.grad is not None]
            if grown:
                self._come += sum(p.numel() * p.element_size() for p in grown)
                self._to_come = [p for p in self._to_come if p.grad is None]
        allocated = (backend.memory_allocated() or 0) - self._come
        if allocated > self._sampled:
            self._sampled = allocated

    def over(self, backend: DeviceBackend, predicted: int, budget: int, watch: bool) -> bool:
        """The last step ended: True (once, when ``watch``) when its peak exceeded
        ``predicted`` by more than :data:`REPLAN_MARGIN` of ``budget``; the excess is
        then :attr:`excess` and a warning says so."""
        floor = self._floor
        peak = backend.max_memory_allocated() if floor is not None else None
        if peak is None or floor is None:
            return False
        self.exact = peak > self._record
        top = peak - self._gradients if self.exact else self._sampled
        self.measured_peak = measured = max(0, top - floor)
        if self._fired or not watch or measured <= predicted + REPLAN_MARGIN * budget:
            return False
        self._fired = True
        self.excess += measured - predicted
        warn_once_per_call_site(
            f"cpu_offload: {self.api}(memory_budget=...): the last step's activations "
            f"peaked at {size(measured)} above the {size(floor)} allocated when it started "
            f"(less {size(self._gradients)} of gradients it may have allocated), "
            f"{size(measured - predicted)} more than predicted (over {REPLAN_MARGIN:.0%} of "
            "the budget). That excess, which the plan does not count (temporaries, the "
            "allocator's rounding), is taken off the budget and the policy is chosen again "
            "from this step on. This warning is shown once."
        )
        return True
