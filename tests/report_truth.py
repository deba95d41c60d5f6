"""The hook-level truth a step report is checked against: what the pack hooks were handed,
recorded by a spy around ``OffloadableLayerState.push_tensor`` (and ``keep_tensor``, for
``modules=``), each tensor classified as the push path decides (``selection.kept_because``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from cpu_offload.engine.layer_state import OffloadableLayerState
from cpu_offload.hooks.selection import KEPT_BY_MODULES, PARAMETER, kept_because
from cpu_offload.report.step_report import REASONS


def reason_of(tensor: torch.Tensor, device: torch.device, numel: int, nbytes: int) -> str | None:
    """Why the offloader keeps ``tensor`` (None: it moves), as the push path decides."""
    if type(tensor) is nn.Parameter:
        return PARAMETER
    return kept_because(tensor, device, numel, nbytes)


class Spy:
    """Per layer (its index), ``(bytes, reason)`` of each tensor the pack hook got."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, min_numel: int, min_bytes: int = 0):
        self.saved: dict[int, list[tuple[int, str | None]]] = defaultdict(list)
        original = OffloadableLayerState.push_tensor
        spy = self

        def push(state: OffloadableLayerState, tensor: Any) -> Any:
            handle = original(state, tensor)
            if not state.name.startswith("layer "):  # a memory budget's probe of the inputs
                return handle
            why = reason_of(tensor, state.backend.device, min_numel, min_bytes)
            spy.saved[state.layer_index].append((tensor.numel() * tensor.itemsize, why))
            return handle

        def keep(state: OffloadableLayerState, tensor: Any) -> Any:
            handle = kept(state, tensor)  # modules= keeps what its submodule saved
            why = reason_of(tensor, state.backend.device, min_numel, min_bytes)
            spy.saved[state.layer_index].append((tensor.nbytes, why or KEPT_BY_MODULES))
            return handle

        kept = OffloadableLayerState.keep_tensor
        monkeypatch.setattr(OffloadableLayerState, "push_tensor", push)
        monkeypatch.setattr(OffloadableLayerState, "keep_tensor", keep)

    def clear(self) -> None:
        self.saved.clear()

    def kept(self, layer: int) -> dict[str, tuple[int, int]]:
        found: dict[str, list[int]] = {}
        for nbytes, why in self.saved[layer]:
            if why is not None:
                entry = found.setdefault(REASONS[why][1], [0, 0])
                entry[0] += 1
                entry[1] += nbytes
        return {reason: (t, b) for reason, (t, b) in found.items()}


def assert_row_matches(row: Any, spy: Spy) -> None:
    saved = spy.saved[row.index]
    moved = [nbytes for nbytes, why in saved if why is None]
    assert (row.saved_tensors, row.saved_bytes) == (len(saved), sum(n for n, _ in saved))
    assert (row.moved_tensors, row.moved_bytes) == (len(moved), sum(moved))
    assert row.kept_because == spy.kept(row.index)
    assert row.moved_tensors + row.kept_tensors == row.saved_tensors
    assert row.moved_bytes + row.kept_bytes == row.saved_bytes
