"""What a step's layers did with their saved tensors, counted as the hooks decide: the
counts a step report is built from (``step_report.py``).

NOTE [Counting saved tensors for nearly nothing]
    Every figure is counted where its decision is already made, so that the hooks pay
    almost nothing for the report: a tensor kept under the threshold appends its bytes
    to one list of its layer (a list append is the cheapest count Python has); a tensor
    kept for another reason appends ``(reason, bytes)``; the tensors that move are
    counted per layer when its copies start (from the sizes the copies need anyway), and
    the host cap's refusals there too.  Nothing is summed until a report is asked for.
    Layers without hooks (not offloaded) are not seen: their saved tensors stay with
    autograd, uncounted, and the report says so.

NOTE [What the report counts]
    ``saved``, ``moved`` and ``kept`` count saves: each tensor autograd handed the pack
    hook, once per save (a tensor saved twice counts twice, a view as its own bytes),
    parameters included; moved + kept = saved.  ``copied`` counts the copies to the host
    that moved them: a tensor saved twice is copied once, views of one tensor move as
    their base, so a layer copies fewer tensors, and often fewer bytes, than it moves.
    ``copied`` is what ``stats.tensors_offloaded`` and ``stats.bytes_offloaded`` count
    (per step here, running totals there) and what a plan's ``copied`` column predicts
    (``LayerProfile.offloaded_bytes``); a plan's ``activations`` column is the memory the
    saved activations hold (each storage once, parameters left out), which the report
    does not count.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = [
    "HOST_CAP",
    "NOT_COPIED",
    "CountsSource",
    "Measured",
    "SaveCounts",
    "StepRecord",
    "nominal_bytes",
]

#: kept because the host buffer pool was at ``max_host_bytes``
HOST_CAP = "host cap"
#: pushed to move, but the layer's offload never started (the last chunk of a
#: whole-forward context; a layer the manual controller did not offload)
NOT_COPIED = "not copied"


class SaveCounts:
    """What one layer (or chunk) did with the tensors saved in its forward; see NOTE
    [Counting saved tensors for nearly nothing].

    Attributes:
        kept_fast: per tensor kept at the two commonest decisions, its bytes if it was
            under the threshold, or ``~bytes`` (negative) if it was a parameter; the
            layer state's own list, appended to by its push.
        kept: ``(reason, bytes)`` of each tensor kept for another reason at push.
        moved, moved_bytes: saved tensors whose data went to the host (a tensor saved
            twice counts twice; its bytes are its own, a view's its view's).
        capped, capped_bytes: tensors the host cap kept.
        not_copied, not_copied_bytes: tensors pushed to move whose offload never started.
        copied, copied_bytes: copies to the host and their bytes (a tensor saved twice
            is copied once, a view that moves through its base as that base, whole):
            ``stats.tensors_offloaded`` and ``stats.bytes_offloaded`` of the layer's step.
        released_bytes: of those, bytes dropped from the device before backward.
        reloaded_bytes: bytes copied back.
        on_demand: whether backward needed the layer before its reload was scheduled.
    """

    # the counts are class attributes until a layer has something to count (most never do)
    moved = moved_bytes = capped = capped_bytes = not_copied = not_copied_bytes = 0
    copied = copied_bytes = released_bytes = reloaded_bytes = 0
    on_demand = False

    def __init__(self, kept_fast: list[int] | None = None) -> None:
        self.kept_fast: list[int] = [] if kept_fast is None else kept_fast
        self.kept: list[tuple[str, int]] = []

    def save_counts(self) -> SaveCounts:
        return self

    def with_not_copied(self, tensors: int, nbytes: int) -> SaveCounts:
        """A copy that also counts ``tensors`` pushed to move and not copied (yet)."""
        counts = SaveCounts()
        counts.__dict__.update(self.__dict__)
        counts.not_copied += tensors
        counts.not_copied_bytes += nbytes
        return counts


class CountsSource(Protocol):
    """What a step record holds per layer: its counts, asked for when a report is built."""

    def save_counts(self) -> SaveCounts: ...


#: host reserved and in-use bytes, device bytes (None: not reported), at a forward's end
Measured = tuple[int, int, "int | None"]


class StepRecord:
    """A step as it ends, cheap to make; :class:`StepRecorder` builds its report.

    Attributes:
        forward_pass: the index of its forward pass.
        layers: per layer (or chunk), its counts, or None where no hooks saw it.
        end_of_forward: what was measured at the end of its forward, if it ended.
        device_peak_bytes: the device's peak allocation when the step ended.
        host_allocations: host blocks the pool allocated since the previous step ended.
        host_cap_bytes: the pool's cap (``max_host_bytes``), None without one.
        recomputed: the layers whose checkpoint recomputed in the step's backward.
        choices: the policy the step ran under, where it changes between steps (a
            memory budget's plan), else None.
        backward_ran: whether a backward unpacked what the step's forward moved (a
            whole-forward context's step is reported only then), or the forward moved
            nothing (then nothing tells).
    """

    __slots__ = (
        "forward_pass",
        "layers",
        "end_of_forward",
        "device_peak_bytes",
        "host_allocations",
        "host_cap_bytes",
        "recomputed",
        "choices",
        "backward_ran",
    )

    def __init__(
        self,
        forward_pass: int,
        layers: list[CountsSource | None],
        end_of_forward: Measured | None = None,
    ) -> None:
        self.forward_pass = forward_pass
        self.layers = layers
        self.end_of_forward = end_of_forward
        self.device_peak_bytes: int | None = None
        self.host_allocations = 0
        self.host_cap_bytes: int | None = None
        self.recomputed: frozenset[int] | set[int] = frozenset()
        self.choices: list[str] | None = None
        self.backward_ran = False


def nominal_bytes(tensor: Any) -> int:
    """Elements times element size: what the report counts a saved tensor as (a sparse
    or nested tensor's nominal size), 0 for a tensor that cannot say."""
    try:
        return int(tensor.numel()) * int(tensor.itemsize)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return 0
