"""What the last step did: per layer (or chunk), the tensors saved, moved and kept, and why,
and the copies that moved them (NOTE [What the report counts] in step_record.py).

NOTE [What a step is]
    A step is one forward pass and the backward through it.  The report of a step is
    taken when that backward has finished with the pass: for the layer API (a
    synchronizer), at the end of each backward call through the pass; for the whole-
    forward context (``chunked.py``), when the backward has freed the forward's saved
    tensors (with ``retain_graph=True``, when the graph goes).  With gradient
    accumulation the last micro-batch is the last step.  A forward without a backward
    (evaluation, a dropped graph) or one that raised replaces nothing; the whole-forward
    context knows a backward ran from the first unpack of a tensor it was handed to
    move (a forward that moved nothing is reported when its graph goes).

The counts a report is built from are taken by the hooks (``step_record.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..hooks.selection import (
    BIT_OR_TRACING,
    KEPT_BY_MODULES,
    MARKED,
    NOT_DENSE,
    NOT_STRIDED,
    OTHER_DEVICE,
    PARAMETER,
    SMALL,
    SUBCLASS,
)
from .step_record import HOST_CAP, NOT_COPIED, SaveCounts, StepRecord

__all__ = ["EndOfForward", "LayerRow", "REASONS", "StepRecorder", "StepReport"]


#: per reason a tensor stayed: the key loggers see, and how the table says it
REASONS: dict[str, tuple[str, str]] = {  # in the order the offloader asks
    PARAMETER: ("parameter", "parameter"),
    SUBCLASS: ("subclass", "tensor subclass"),
    SMALL: ("threshold", "under the threshold"),
    OTHER_DEVICE: ("other_device", "on another device"),
    NOT_STRIDED: ("not_strided", "not strided"),
    MARKED: ("marked", "marked not to offload"),
    BIT_OR_TRACING: ("conj_neg_traced", "conj/neg bit or traced"),
    NOT_DENSE: ("not_dense", "not dense"),
    HOST_CAP: ("host_cap", "over max_host_bytes"),
    KEPT_BY_MODULES: ("modules_keep", "kept by modules="),
    NOT_COPIED: ("not_offloaded", "offload never started"),
}
_LAST_CHUNK = ("last_chunk", "in the last chunk")
#: pushed to a layer that the policy does not offload (observed by a memory budget's plan)
_LAYER_KEPT = ("layer_kept", "the policy keeps its layer")


@dataclass(frozen=True)
class EndOfForward:
    """Memory at the end of a forward pass, where activation memory peaks.

    Attributes:
        host_reserved_bytes, host_in_use_bytes: the host buffer pool's, as torch's
            pinned allocator holds them (NOTE [Pinned sizes as torch holds them]).
        device_bytes: allocated on the device (None: the device reports no memory).
        released_bytes: bytes the step's layers had copied out and dropped from the
            device (before its backward).
    """

    host_reserved_bytes: int
    host_in_use_bytes: int
    device_bytes: int | None
    released_bytes: int


@dataclass
class LayerRow:
    """One layer (or chunk) of a :class:`StepReport`.

    Attributes:
        index: the layer's (or chunk's) position.
        choice: ``offload``, ``keep``, ``checkpoint``, ``checkpoint+offload``, ``manual``
            or ``chunk``.
        counted: whether hooks saw its saved tensors (False: not offloaded, uncounted).
        kept_because: per reason (:data:`REASONS`' description), ``(tensors, bytes)``.
        saved_*, moved_*, kept_*: tensors its forward saved (each save counted), moved
            to the host and kept; copied_*: the copies that moved them, as the
            statistics count (NOTE [What the report counts] in step_record.py).
        reloaded_bytes: bytes copied back.
        recomputed: for a checkpointed layer, whether its checkpoint recomputed it in
            the step's backward; None for other layers.
        note: what the row says instead of counts, or after them.
    """

    index: int
    choice: str
    counted: bool = False
    saved_tensors: int = 0
    saved_bytes: int = 0
    moved_tensors: int = 0
    moved_bytes: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    kept_because: dict[str, tuple[int, int]] = field(default_factory=dict)
    copied_tensors: int = 0
    copied_bytes: int = 0
    reloaded_bytes: int = 0
    on_demand: bool = False
    recomputed: bool | None = None
    note: str = ""


def _row(index: int, choice: str, counts: SaveCounts) -> LayerRow:
    row = LayerRow(index, choice, counted=True)
    kept: dict[str, list[int]] = {}
    for nbytes in counts.kept_fast:
        reason, nbytes = (SMALL, nbytes) if nbytes >= 0 else (PARAMETER, ~nbytes)
        entry = kept.setdefault(reason, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    for reason, nbytes in counts.kept:
        entry = kept.setdefault(reason, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    for reason, tensors, nbytes in (
        (HOST_CAP, counts.capped, counts.capped_bytes),
        (NOT_COPIED, counts.not_copied, counts.not_copied_bytes),
    ):
        if tensors:
            kept[reason] = [tensors, nbytes]
    for reason in REASONS:
        if reason not in kept:
            continue
        tensors, nbytes = kept[reason]
        words = REASONS[reason][1]
        if reason == NOT_COPIED and choice not in ("offload", "checkpoint+offload", "manual"):
            words = (_LAST_CHUNK if choice == "chunk" else _LAYER_KEPT)[1]
        row.kept_because[words] = (tensors, nbytes)
        row.kept_tensors += tensors
        row.kept_bytes += nbytes
    row.moved_tensors, row.moved_bytes = counts.moved, counts.moved_bytes
    row.saved_tensors = row.moved_tensors + row.kept_tensors
    row.saved_bytes = row.moved_bytes + row.kept_bytes
    row.copied_tensors, row.copied_bytes = counts.copied, counts.copied_bytes
    row.reloaded_bytes = counts.reloaded_bytes
    row.on_demand = counts.on_demand
    return row


def _key(words: str) -> str:
    """The logger key of a reason given in words."""
    for key, said in (*REASONS.values(), _LAST_CHUNK, _LAYER_KEPT):
        if said == words:
            return key
    return words.replace(" ", "_")  # pragma: no cover - every reason is listed


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


@dataclass
class StepReport:
    """The last completed step of an offload context (NOTE [What a step is]).

    ``print(report)`` gives a short table; :meth:`to_dict` the totals as flat scalars
    for loggers.  Totals add up: moved + kept = saved, in tensors and in bytes, over the
    layers whose saved tensors the hooks saw (``counted``); ``copied`` counts the copies
    that moved them, as the statistics do (NOTE [What the report counts]).

    Attributes:
        step: steps the context has completed (0: none yet, and the report is empty).
        forward_pass: the index of the step's forward pass.
        unit: ``"layer"`` or ``"chunk"``.
        rows: one :class:`LayerRow` per layer (or chunk).
        device: the device whose tensors are offloaded.
        end_of_forward: memory at the end of the step's forward, if measured.
        device_peak_bytes: the device's peak allocation since its last
            ``reset_peak_memory_stats`` (None: the device reports no memory).
        host_allocations: host blocks the pool allocated for the step (since the step
            before it ended), each one pinned allocation (``cudaHostAlloc``, ~3 ms): 0
            at fixed shapes after the first step.
        host_cap_bytes: the host pool's cap (``max_host_bytes``), None without one.
    """

    step: int = 0
    forward_pass: int | None = None
    unit: str = "layer"
    rows: list[LayerRow] = field(default_factory=list)
    device: str = ""
    end_of_forward: EndOfForward | None = None
    device_peak_bytes: int | None = None
    host_allocations: int = 0
    host_cap_bytes: int | None = None

    def _total(self, name: str) -> int:
        return sum(getattr(row, name) for row in self.rows if row.counted)

    @property
    def saved_tensors(self) -> int:
        return self._total("saved_tensors")

    @property
    def saved_bytes(self) -> int:
        return self._total("saved_bytes")

    @property
    def moved_tensors(self) -> int:
        return self._total("moved_tensors")

    @property
    def moved_bytes(self) -> int:
        return self._total("moved_bytes")

    @property
    def copied_tensors(self) -> int:
        return self._total("copied_tensors")

    @property
    def copied_bytes(self) -> int:
        return self._total("copied_bytes")

    @property
    def kept_tensors(self) -> int:
        return self._total("kept_tensors")

    @property
    def kept_bytes(self) -> int:
        return self._total("kept_bytes")

    @property
    def kept_because(self) -> dict[str, tuple[int, int]]:
        """Per reason, the tensors and bytes kept over all counted rows."""
        found: dict[str, list[int]] = {}
        for row in self.rows:
            for reason, (tensors, nbytes) in row.kept_because.items():
                entry = found.setdefault(reason, [0, 0])
                entry[0] += tensors
                entry[1] += nbytes
        return {reason: (t, b) for reason, (t, b) in found.items()}

    @property
    def recomputed_layers(self) -> list[int]:
        return [row.index for row in self.rows if row.recomputed]

    def to_dict(self) -> dict[str, int]:
        """The report's scalars, flat, for loggers (empty before the first step)."""
        if not self.step:
            return {}
        scalars = {
            "step": self.step,
            "saved_tensors": self.saved_tensors,
            "saved_bytes": self.saved_bytes,
            "moved_tensors": self.moved_tensors,
            "moved_bytes": self.moved_bytes,
            "kept_tensors": self.kept_tensors,
            "kept_bytes": self.kept_bytes,
        }
        for reason, (tensors, nbytes) in self.kept_because.items():
            scalars[f"kept_tensors/{_key(reason)}"] = tensors
            scalars[f"kept_bytes/{_key(reason)}"] = nbytes
        scalars["copied_tensors"] = self.copied_tensors
        scalars["copied_bytes"] = self.copied_bytes
        scalars["reloaded_bytes"] = self._total("reloaded_bytes")
        checkpointed = [row for row in self.rows if row.recomputed is not None]
        if checkpointed:
            scalars["checkpointed_layers"] = len(checkpointed)
            scalars["recomputed_layers"] = len(self.recomputed_layers)
        end = self.end_of_forward
        if end is not None:
            scalars["host_reserved_bytes"] = end.host_reserved_bytes
            scalars["host_in_use_bytes"] = end.host_in_use_bytes
            scalars["released_bytes"] = end.released_bytes
            scalars["host_allocations"] = self.host_allocations
            if end.device_bytes is not None:
                scalars["device_bytes_end_of_forward"] = end.device_bytes
                scalars["device_bytes_keeping_everything"] = end.device_bytes + end.released_bytes
        if self.device_peak_bytes is not None:
            scalars["device_peak_bytes"] = self.device_peak_bytes
        if self.host_cap_bytes is not None:
            scalars["host_cap_bytes"] = self.host_cap_bytes
        return scalars

    def __str__(self) -> str:
        if not self.step:
            return (
                "cpu_offload: no step has completed yet (a step is a forward pass and its "
                "backward; the report is taken when that backward has finished)."
            )
        lines = [
            f"cpu_offload: step {self.step} (forward pass {self.forward_pass} and its "
            f"backward): {self.saved_tensors} tensors saved ({mib(self.saved_bytes)}; each "
            f"save counted), moved {self.moved_tensors} tensors ({mib(self.moved_bytes)}) to "
            f"the host, kept {self.kept_tensors} ({mib(self.kept_bytes)}); copied "
            f"{self.copied_tensors} tensors ({mib(self.copied_bytes)}) to the host (a "
            "tensor saved twice, or views of one, copied once)",
            f"{self.unit:<7}{'':<19}{'saved':>19}{'moved':>19}{'kept':>19}{'copied':>19}  why kept",
        ]
        for row in self.rows:
            lines.append(_row_line(row))
        lines.append(_row_line(self._totals_row(), total=True))
        if not all(row.counted for row in self.rows):
            lines.append(
                "(-: no hooks in that layer, so what it saved stays with autograd, uncounted)"
            )
        lines.extend(self._memory_lines())
        return "\n".join(lines)

    def _totals_row(self) -> LayerRow:
        total = LayerRow(-1, "total", counted=True, kept_because=self.kept_because)
        for name in ("saved", "moved", "kept", "copied"):
            setattr(total, f"{name}_tensors", getattr(self, f"{name}_tensors"))
            setattr(total, f"{name}_bytes", getattr(self, f"{name}_bytes"))
        return total

    def _memory_lines(self) -> list[str]:
        end = self.end_of_forward
        if end is None:
            return []
        lines = [
            f"host memory at the end of forward: {mib(end.host_in_use_bytes)} in use, "
            f"{mib(end.host_reserved_bytes)} reserved, {self.host_allocations} host "
            "allocations in the step"
            + ("" if self.host_cap_bytes is None else f", cap {mib(self.host_cap_bytes)}")
        ]
        if end.device_bytes is None:
            lines.append(
                f"device memory: not known ({self.device} reports no memory statistics); "
                f"{mib(end.released_bytes)} had been moved off it by the end of forward"
            )
        else:
            peak = (
                f", peak {mib(self.device_peak_bytes)} since the last reset_peak_memory_stats"
                if self.device_peak_bytes is not None
                else ""
            )
            lines.append(
                f"device memory at the end of forward: {mib(end.device_bytes)} measured{peak}; "
                f"keeping everything: up to {mib(end.device_bytes + end.released_bytes)} "
                f"(+{mib(end.released_bytes)} moved off the device by then)"
            )
        return lines


def _amount(tensors: int, nbytes: int) -> str:
    return f"{tensors:>6} {mib(nbytes):>12}"


def _row_line(row: LayerRow, total: bool = False) -> str:
    label = "total" if total else str(row.index)
    choice = "" if total else row.choice
    head = f"{label:<7}{choice:<19}"
    if not row.counted:
        return head + f"{'-':>19}{'-':>19}{'-':>19}{'-':>19}  {row.note}".rstrip()
    why = ", ".join(f"{reason}: {t}" for reason, (t, _) in row.kept_because.items())
    extra = [why] if why else []
    if row.on_demand:
        extra.append("reloaded on demand")
    if row.note:
        extra.append(row.note)
    return (
        head
        + _amount(row.saved_tensors, row.saved_bytes)
        + _amount(row.moved_tensors, row.moved_bytes)
        + _amount(row.kept_tensors, row.kept_bytes)
        + _amount(row.copied_tensors, row.copied_bytes)
        + ("  " + "; ".join(extra) if extra else "")
    )


class StepRecorder:
    """Keeps the last completed step of one context, and builds its report when asked.

    Attributes:
        steps: steps completed so far.
    """

    __slots__ = ("steps", "_last", "_recomputed")

    def __init__(self) -> None:
        self.steps = 0
        self._last: StepRecord | None = None
        # per forward pass (its index), the layers recomputed in its backward so far
        self._recomputed: dict[int | None, set[int]] = {}

    def note_recompute(self, forward_pass: int | None, *layers: int) -> None:
        """A checkpoint recomputed ``layers`` (one module at each) in the backward of
        ``forward_pass`` (its index; None: the backward under way, whichever pass it
        is).  Counted per pass: one pass's backward may interleave with another's
        (interleaved and zero-bubble pipeline schedules, one backward through two passes)."""
        self._recomputed.setdefault(forward_pass, set()).update(layers)

    def last_choices(self) -> list[str] | None:
        """The policy the last step ran under, where it changes between steps."""
        return self._last.choices if self._last is not None else None

    def publish(self, record: StepRecord) -> None:
        """``record``'s step has ended (NOTE [What a step is])."""
        recomputed = self._recomputed.pop(record.forward_pass, set())
        recomputed |= self._recomputed.pop(None, set())
        if recomputed:
            record.recomputed = recomputed
        self._last = record
        self.steps += 1

    def report(
        self,
        device: str,
        unit: str = "layer",
        choices: Sequence[str] | None = None,
        notes: dict[int, str] | None = None,
        checkpointed: Sequence[int] = (),
    ) -> StepReport:
        """The last step's report; ``choices`` name each layer's policy (default:
        ``offload`` where hooks saw it, else ``keep``), ``notes`` say why a layer was
        not counted, ``checkpointed`` lists the layers a checkpoint wraps."""
        record = self._last
        if record is None:
            return StepReport(unit=unit, device=device)
        rows = []
        for index, source in enumerate(record.layers):
            choice = choices[index] if choices is not None else ("offload" if source else "keep")
            if unit == "chunk":
                choice = "chunk"
            if source is None:
                row = LayerRow(index, choice, note=(notes or {}).get(index, ""))
            else:
                row = _row(index, choice, source.save_counts())
            if index in checkpointed:
                row.recomputed = index in record.recomputed
                said = "recomputed in backward" if row.recomputed else "NOT recomputed"
                row.note = f"{said}; {row.note}" if row.note else said
            rows.append(row)
        end = None
        if record.end_of_forward is not None:
            released = sum(
                source.save_counts().released_bytes for source in record.layers if source
            )
            end = EndOfForward(*record.end_of_forward, released)
        return StepReport(
            step=self.steps,
            forward_pass=record.forward_pass,
            unit=unit,
            rows=rows,
            device=device,
            end_of_forward=end,
            device_peak_bytes=record.device_peak_bytes,
            host_allocations=record.host_allocations,
            host_cap_bytes=record.host_cap_bytes,
        )
