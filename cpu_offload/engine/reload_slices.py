"""A layer reloaded in slices, in backward order (``reload_slice_bytes=``).

NOTE [Reloading a layer in slices]
    A whole-layer reload (NOTE [Offload stream ordering] in layer_data.py) brings every
    saved tensor of a layer back at the start of its backward, before any of them is
    consumed: the layer's saved bytes on top of everything else.  With
    ``reload_slice_bytes`` the layer's host copies (one per distinct tensor, after group
    processing) are cut into slices of about that many bytes, in reverse pack order
    (the order backward unpacks them in): slice 0 holds the tensors saved last.
    - The reload (``start_reload``) issues slice 0 only.
    - A pop from slice ``s`` issues slice ``s + 1`` if it is not issued yet (prefetch
      depth one slice: a slice's copy runs while the slice before it is consumed), then
      makes its stream wait for slice ``s``'s event (once per slice and stream).
    - A layer reloaded on demand (``reload_on_demand_layers=``, NOTE [Slices at the
      peak]) prefetches nothing: a pop issues its own slice only, when backward first
      takes from it.
    - A pop from a slice not issued yet (a tensor unpacked out of order) issues that
      slice at once and waits for it: never wrong, only slower; it is counted in
      ``OffloadStats.slices_on_demand``.
    Each slice's device tensors are allocated on the compute stream, then the offload
    stream waits for the compute stream, then copies, then records the slice's event:
    the same ordering as a whole reload, per slice.  The tensors still go one by one as
    their pops hand them out (NOTE [Reloaded tensors go one by one]); a position popped
    again gets a new copy of its host copy, as there.  A layer that is not sliced, or
    whose copies fit one slice, reloads whole.

NOTE [Slices at the peak]
    A step whose backward allocates the parameter gradients peaks in the backward of
    its first layer, when every layer's gradients are there.  In a Llama layer that is
    the SwiGLU multiply's backward, which takes two 224 MiB slices (at 8k) and makes two
    outputs of that size: with the prefetch, the slice after them (the gate's output,
    for the SiLU's backward next) is on the device too, 224 MiB that
    ``save_on_cpu``, copying each tensor as it is unpacked, does not hold there.  So the
    layers of ``reload_on_demand_layers=`` bring each slice as backward first takes from
    it: the slices' copies are exposed in that layer's backward, and its peak is the
    nodes' own.  The planner names layer 0 (``PolicyPlan.reload_on_demand_layers``)
    where the step's gradients are counted and only that fits the budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from ..device.amounts import integer, parse_bytes
from ..report.step_record import SaveCounts
from .layer_data import CopyingLayer, LayerData, copy_timed, hand_out

__all__ = ["SlicedReload", "check_on_demand", "check_slice_bytes", "slice_sources"]


def check_slice_bytes(value: object, api: str) -> int | None:
    """``reload_slice_bytes=`` checked: None (whole-layer reloads), an int >= 1 (of any
    integer type) or a size string (``"64MiB"``, as amounts of memory are written)."""
    if value is None:
        return None
    whole = integer(value)
    if isinstance(value, str):
        try:  # the string of a number is that number: bytes, as an int here is
            number = float(value)
        except ValueError:
            number = parse_bytes(value, "reload_slice_bytes", api)
        if not float(number).is_integer():
            raise ValueError(f"{api}: reload_slice_bytes={value!r} is not a whole number of bytes.")
        whole = int(number)
    elif whole is None:
        raise TypeError(
            f"{api}: reload_slice_bytes must be None (reload each offloaded layer whole), "
            f"an int of bytes >= 1 or a size such as '64MiB', got {type(value).__name__} "
            f"{value!r}."
        )
    if whole < 1:
        raise ValueError(
            f"{api}: reload_slice_bytes must be >= 1 (bytes per slice of a reloaded layer), "
            f"got {whole}; pass None to reload each offloaded layer whole."
        )
    return whole


def check_on_demand(
    value: object, slice_bytes: int | None, layers: int, api: str
) -> frozenset[int]:
    """``reload_on_demand_layers=`` checked: layer indices in ``[0, layers)``, given only
    with ``reload_slice_bytes`` (NOTE [Slices at the peak])."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{api}: reload_on_demand_layers must be a sequence of layer indices, got "
            f"{type(value).__name__} {value!r}."
        )
    given = list(value)
    indices: list[int] = []
    for index in given:
        whole = integer(index)
        if whole is None or not 0 <= whole < layers:
            raise ValueError(
                f"{api}: reload_on_demand_layers must hold layer indices in [0, {layers}), "
                f"got {index!r} in {given!r}."
            )
        indices.append(whole)
    if indices and slice_bytes is None:
        raise ValueError(
            f"{api}: reload_on_demand_layers={indices!r} says which layers reloaded in "
            "slices take no prefetch; it needs reload_slice_bytes= (whole-layer reloads "
            "have no slices). Pass reload_slice_bytes, or leave reload_on_demand_layers out."
        )
    return frozenset(indices)


def slice_sources(sizes: list[int], slice_bytes: int) -> list[list[int]]:
    """The indices of ``sizes`` (in pack order) as slices in reverse pack order: each
    slice takes tensors from the end until it holds at least ``slice_bytes``."""
    slices: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index in reversed(range(len(sizes))):
        current.append(index)
        held += sizes[index]
        if held >= slice_bytes:
            slices.append(current)
            current, held = [], 0
    if current:
        slices.append(current)
    return slices


class SlicedReload:
    """The slices of one reload of a layer; see NOTE [Reloading a layer in slices].

    Attributes:
        slices: per slice, the indices of its distinct tensors (host copies).
        slice_of: per distinct tensor, its slice.
        positions: per distinct tensor, the pushed positions it goes back to.
        issued: per slice, whether its copies were issued.
        events: per slice, its copies' event (None until issued, or none copied).
        waited: per slice, the stream keys that waited for its event.
        allocated_on: per slice, the stream key current when it was allocated: a pop on
            another stream hands its tensor to ``record_stream`` (NOTE [Allocator reuse
            across streams] in testing/allocator_pools.py).
    """

    __slots__ = (
        "slices",
        "slice_of",
        "positions",
        "issued",
        "events",
        "waited",
        "allocated_on",
        "saves",
        "prefetch",
    )

    def __init__(
        self, data: LayerData, slice_bytes: int, saves: SaveCounts, prefetch: bool = True
    ) -> None:
        self.saves = saves  # the cycle's counts: each slice's bytes as it is copied back
        self.prefetch = prefetch  # False: on demand (NOTE [Slices at the peak])
        sizes = [shape.numel() * dtype.itemsize for shape, _, dtype in data.layouts]
        self.slices = slice_sources(sizes, slice_bytes)
        self.slice_of = [0] * len(sizes)
        for number, sources in enumerate(self.slices):
            for source in sources:
                self.slice_of[source] = number
        layout = data.layout
        self.positions: list[list[int]] = [[] for _ in sizes]
        if layout is None:
            for source in range(len(sizes)):
                self.positions[source].append(source)
        else:
            for position, source in enumerate(layout.source_index):
                self.positions[source].append(position)
        count = len(self.slices)
        self.issued = [False] * count
        self.events: list[Any] = [None] * count
        self.waited: list[set[object]] = [set() for _ in range(count)]
        self.allocated_on: list[object] = [None] * count

    @classmethod
    def start(
        cls,
        data: LayerData,
        layer: CopyingLayer,
        slice_bytes: int,
        saves: SaveCounts,
        prefetch: bool = True,
    ) -> SlicedReload:
        """Begin a reload of ``data`` in slices: issue slice 0 (the tensors saved last);
        ``saves``: the counts of the layer's cycle (``reloaded_bytes``); ``prefetch``:
        False, each later slice is issued by its first pop (NOTE [Slices at the peak])."""
        sliced = cls(data, slice_bytes, saves, prefetch)
        positions = sum(len(p) for p in sliced.positions)
        data.reloaded = [None] * positions
        data.reload_event = None  # per slice instead
        data.in_flight = []
        data.pops_left = None if data.shares is None else dict(data.shares)
        sliced.issue(data, layer, 0)
        return sliced

    def issue(self, data: LayerData, layer: CopyingLayer, number: int) -> None:
        """Allocate slice ``number`` on the compute stream and queue its copies after
        the compute stream's work (NOTE [Reloading a layer in slices])."""
        self.issued[number] = True
        sources = self.slices[number]
        backend = layer.backend
        stay, host = data.stay, data.host
        moving = [s for s in sources if host[s] is not None]
        with torch.no_grad():
            hosts = [cast(torch.Tensor, host[s]) for s in moving]
            targets = backend.empty_device_many([data.layouts[s] for s in moving], hosts)
            if not backend.one_stream:
                self.allocated_on[number] = backend.current_stream_key()
            if targets:
                stream = layer.offload_stream
                backend.wait_stream(stream, backend.current_stream())
                nbytes = sum(h.nbytes for h in hosts)
                copy_timed(layer, "h2d", targets, hosts, nbytes)
                self.saves.reloaded_bytes += nbytes
                event = self.events[number] = backend.record_event(stream)
                data.in_flight.append(event)
        device = dict(zip(moving, targets))
        layout = data.layout
        for source in sources:
            tensor = device[source] if source in device else cast(torch.Tensor, stay[source])
            for position in self.positions[source]:
                view = None if layout is None else layout.views[position]
                data.reloaded[position] = tensor if view is None else tensor.as_strided(*view)

    def hand_out(self, data: LayerData, layer: CopyingLayer, position: int) -> torch.Tensor:
        """The reloaded tensor at ``position`` for a pop: its slice issued (at once if
        it was not: out of order), the next slice issued, the pop's stream made to wait
        for its slice's copies."""
        layout = data.layout
        number = self.slice_of[position if layout is None else layout.source_index[position]]
        if not self.issued[number]:
            layer.stats.slices_on_demand += 1
            self.issue(data, layer, number)
        following = number + 1
        if self.prefetch and following < len(self.slices) and not self.issued[following]:
            self.issue(data, layer, following)
        event = self.events[number]
        if event is None:
            return hand_out(data, layer, position)
        backend = layer.backend
        key = None if backend.one_stream else backend.current_stream_key()
        waited = self.waited[number]
        if key not in waited:
            backend.wait_event(backend.current_stream(), event)
            waited.add(key)
        tensor = hand_out(data, layer, position)
        if key != self.allocated_on[number]:  # its block is that stream's: reused after ours
            backend.record_stream(tensor, backend.current_stream())
        return tensor
