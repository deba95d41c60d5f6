"""A failed step under offload_layers(memory_budget=...) holds nothing after its error:
with the garbage collector off, the failed step's tensors die with the user's last
reference and no pass stays in flight (issue 40, item 5)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cpu_offload import offload_layers

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

WIDTH, LAYERS = 16, 4


class Boom(Exception):
    pass


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.fail: type[BaseException] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.linear(x))
        if self.fail is not None:
            raise self.fail
        return out


def failing_step(layers: list[Block], at: int, error: type[BaseException]) -> list[weakref.ref]:
    """A forward that raises ``error`` in layer ``at``; weak references to what it made."""
    x = torch.randn(32, WIDTH, requires_grad=True)
    made = [weakref.ref(x)]
    layers[at].fail = error
    h = x
    try:
        with pytest.raises(error):
            for layer in layers:
                h = layer(h)
                made.append(weakref.ref(h))
    finally:
        layers[at].fail = None
    del x, h
    return made


@pytest.mark.parametrize(
    ("steps_before", "at", "error"),
    [
        (0, 2, Boom),  # a layer of the measured step
        (0, 0, KeyboardInterrupt),  # an interrupt (a caught out-of-memory error alike)
        (2, 0, Boom),  # layer 0 of a planned step, observed in every step
        (2, 1, RuntimeError),
    ],
    ids=["measured-layer-2", "measured-interrupt", "planned-layer-0", "planned-layer-1"],
)
def test_a_failed_step_holds_nothing_after_its_error(steps_before, at, error):
    torch.manual_seed(0)
    layers = [Block() for _ in range(LAYERS)]
    handle = offload_layers(layers, memory_budget="1TiB", min_offload_numel=0)
    synchronizer = handle.offload_synchronizer
    x = torch.randn(32, WIDTH)
    for _ in range(steps_before):
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()
        del h
    assert (handle.plan is not None) == (steps_before > 0)
    gc.collect()
    gc.disable()
    try:
        made = failing_step(layers, at, error)
        if error is KeyboardInterrupt:
            # Forward hooks do not run on an interrupt: the layer is left when the next
            # forward starts (NOTE [Interrupted layer calls]); it starts one here.
            h = x
            for layer in layers:
                h = layer(h)
            h.sum().backward()
            del h
        assert [ref() for ref in made] == [None] * len(made)
        assert synchronizer.in_flight_passes() == []
        # and the next steps run, measured or planned
        for _ in range(2):
            h = x
            for layer in layers:
                h = layer(h)
            h.sum().backward()
            del h
        assert synchronizer.in_flight_passes() == []
    finally:
        gc.enable()
    assert handle.plan is not None
    handle.remove()
