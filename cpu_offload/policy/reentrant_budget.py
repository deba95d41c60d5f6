"""What a budget's measured step counts of layers inside a reentrant checkpoint
(``offload_layers(model, memory_budget=...)`` with torch's ``use_reentrant=True`` or
Megatron's full recompute).

NOTE [A budget around reentrant checkpoints]
    Inside a reentrant checkpoint's ``forward`` the layers run under no-grad and save
    nothing; the device holds what the ``Function`` saves after them (its inputs), and,
    while the chunk's backward runs, everything its recompute saves (NOTE [Layers inside a
    reentrant checkpoint] in reentrant_checkpoint.py).  In the measured step:

    1. each layer of the chunk counts as run with grad (the pass is measured, not taken
       for evaluation), and is never checkpointed again (``in_checkpoint``);
    2. the checkpoint's saved inputs, as they are packed, are measured by the
       offloader's rules in a scratch layer state and added to the record of the chunk's
       last layer (its ``saved_bytes``, ``offloaded_bytes``: the inputs move with that
       layer when it is offloaded);
    3. during the chunk's recompute in the measured step's backward, each layer's
       forward runs under a pair of saved-tensor hooks that note what it saves (handing
       each tensor to the hooks outside, unchanged); they are held until the chunk's
       backward starts, then their storages, less the checkpoint's inputs, parameters and
       buffers and what an earlier layer of the chunk noted, are counted.  Their sum is
       the ``recompute_bytes`` of the chunk's last layer: the event model counts it at
       that layer's backward, the first of the chunk's, when the whole recompute is live;
       the other layers' backward holds no more than that.

    The plan is made when the next pass starts, so the backward's numbers are in.  A
    chunk whose recompute did not run the layers its forward ran (another program in
    backward) keeps its inputs counted only, and one warning says the budget cannot count
    its recompute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..engine.layer_state import OffloadableLayerState
from ..hooks.autograd_hooks import (
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    top_pack_hook,
    top_saved_tensor_hooks,
)
from ..log import warn
from .measured_step import MeasuredLayer, checkpointed_bytes

__all__ = ["ChunkMeasure"]


def _same(value: Any) -> Any:
    return value


class _Recording(threading.local):
    """Per thread: the chunk whose recompute runs now, and its layers' count so far."""

    chunk: ChunkMeasure | None = None
    position = 0
    pushed: Any = None


_recording = _Recording()


class ChunkMeasure:
    """One measured chunk's bytes (NOTE [A budget around reentrant checkpoints]).

    Args:
        records: the measured pass's records (filled as its layers' forwards end).
        new_state: a scratch layer state, for the inputs.
        measure: the synchronizer's measure of pushed tensors.
        excluded: storages of parameters and buffers.
    """

    def __init__(
        self,
        records: list[MeasuredLayer | None],
        new_state: Callable[[], OffloadableLayerState],
        measure: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], MeasuredLayer],
        excluded: frozenset[int],
    ) -> None:
        self.records = records
        self.new_state = new_state
        self.measure = measure
        self.excluded = excluded
        self.order: list[int] = []  #: the chunk's layers, in forward order
        self.inputs: list[torch.Tensor] = []
        self.noted: list[list[torch.Tensor]] = []
        self.warned: Callable[[str], None] = lambda message: warn(message, UserWarning)

    def inputs_saved(self, tensors: list[torch.Tensor]) -> None:
        """The checkpoint packed ``tensors``: count them on the chunk's last layer."""
        if not self.order:
            return
        for layer in self.order:
            ran = self.records[layer]
            if ran is not None:
                ran.in_checkpoint = True
        record = self.records[self.order[-1]]
        if record is None:
            return
        scratch = self.new_state()
        handles = [scratch.push_tensor(t) for t in tensors]
        found = self.measure(tensors, scratch.pending_copies())
        del handles
        record.saved_bytes += found.saved_bytes
        record.offloaded_bytes += found.offloaded_bytes
        record.tensors_offloaded += found.tensors_offloaded
        record.kept_bytes += found.kept_bytes
        for reason, nbytes in found.kept_by_reason.items():
            record.kept_by_reason[reason] = record.kept_by_reason.get(reason, 0) + nbytes
        self.inputs = [t.detach() for t in tensors]

    # ------------------------------------------------------------ recompute

    def recompute_starts(self, *_: Any) -> None:
        """The chunk's node is about to recompute (a pre-hook on it)."""
        _recording.chunk, _recording.position, _recording.pushed = self, 0, None
        self.noted = []

    @staticmethod
    def layer_enters() -> None:
        """A layer's forward starts with grad enabled: note what it saves if it runs in
        the recompute of a measured chunk."""
        chunk = _recording.chunk
        if chunk is None or _recording.pushed is not None:
            return
        noted: list[torch.Tensor] = []
        chunk.noted.append(noted)
        pack, unpack = top_saved_tensor_hooks() or (_same, _same)

        def noting(tensor: Any) -> Any:
            if isinstance(tensor, torch.Tensor):
                noted.append(tensor)
            return pack(tensor)

        push_saved_tensor_hooks(noting, unpack)
        _recording.pushed = noting

    @staticmethod
    def layer_leaves() -> None:
        """The recomputed layer's forward ends: stop noting; after the chunk's last
        layer, count (the whole recompute is live now, before its backward frees it)."""
        pushed, _recording.pushed = _recording.pushed, None
        if pushed is not None and top_pack_hook() is pushed:
            pop_saved_tensor_hooks()
        chunk = _recording.chunk
        if pushed is not None and chunk is not None and len(chunk.noted) == len(chunk.order):
            _recording.chunk = None
            chunk.count()

    def recompute_ends(self, *_: Any) -> None:
        """The chunk's node has run (a hook on it): say so if its recompute was not
        counted."""
        ChunkMeasure.layer_leaves()
        if _recording.chunk is not self:
            return
        _recording.chunk = None
        found, self.noted, self.inputs = len(self.noted), [], []
        self.warned(
            "cpu_offload: offload_layers(memory_budget=...): a reentrant checkpoint's "
            f"backward ran {found} hooked layers where its forward ran {len(self.order)}: "
            "the budget counts its saved inputs but cannot count its recompute. Pass the "
            "number of layers to offload (k) instead."
        )

    def count(self) -> None:
        """What the chunk's recompute holds, on its last layer's record."""
        noted, self.noted = self.noted, []
        seen, self.inputs = self.inputs, []
        total = 0
        for tensors in noted:
            total += checkpointed_bytes(tensors, seen, self.excluded)
            seen = seen + tensors
        record = self.records[self.order[-1]]
        if record is not None:
            record.recompute_bytes = total
