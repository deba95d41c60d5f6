"""A step report under CUDA graphs: which step was captured, and whether the steps
since are its replays (``cuda_graph=``; NOTE [What a replay reports]).

NOTE [What a replay reports]
    A replay runs no Python, so the offloader's hooks see nothing of it: the report of
    a context with ``cuda_graph`` set is that of the last step its hooks saw, with
    ``cuda_graph/captured`` (that step was captured into a graph: it ran nothing then,
    and its figures are what each replay moves), ``cuda_graph/replay`` (no forward went
    through the hooks since the capture, or only forwards of graphed layers, which save
    nothing: the steps running now are the graph's replays) and
    ``cuda_graph/warmup_steps`` (the eager steps before the first capture, as
    ``make_graphed_callables`` and Megatron run them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .step_report import StepReport

__all__ = ["GraphStepReport", "GraphSteps"]


@dataclass
class GraphSteps:
    """What CUDA graphs did with a context's steps (NOTE [What a replay reports]).

    Attributes:
        captured: the reported step was captured into a graph.
        replay: no step the hooks saw since that capture saved a tensor: the steps since
            are replays of it (False before any capture).
        warmup_steps: steps that ran eagerly before the first capture.
        captures: steps captured so far.
    """

    captured: bool = False
    replay: bool = False
    warmup_steps: int = 0
    captures: int = 0


@dataclass
class GraphStepReport(StepReport):
    """A :class:`StepReport` with :class:`GraphSteps` (``cuda_graph``)."""

    cuda_graph: GraphSteps = field(default_factory=GraphSteps)

    @classmethod
    def of(cls, report: StepReport, steps: GraphSteps) -> GraphStepReport:
        """``report`` with ``steps``."""
        return cls(**{f.name: getattr(report, f.name) for f in fields(report)}, cuda_graph=steps)

    def to_dict(self) -> dict[str, int]:
        """:meth:`StepReport.to_dict` with ``cuda_graph/captured``, ``cuda_graph/replay``
        (0 or 1) and ``cuda_graph/warmup_steps``."""
        scalars = super().to_dict()
        if not scalars:  # no step yet
            return scalars
        steps = self.cuda_graph
        scalars["cuda_graph/captured"] = int(steps.captured)
        scalars["cuda_graph/replay"] = int(steps.replay)
        scalars["cuda_graph/warmup_steps"] = steps.warmup_steps
        return scalars

    def __str__(self) -> str:
        steps = self.cuda_graph
        if steps.replay:
            said = "captured into a CUDA graph; the steps since are its replays"
        elif steps.captured:
            said = "captured into a CUDA graph"
        else:
            said = "eager" + (", before any capture" if not steps.captures else "")
        line = (
            f"CUDA graph: this step was {said} ({steps.warmup_steps} warm-up steps before the "
            f"first capture, {steps.captures} captured)"
        )
        return f"{super().__str__()}\n{line}"
