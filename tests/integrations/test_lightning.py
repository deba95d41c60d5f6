"""Lightning as its users run it: ``Trainer(accelerator="cpu")``, with offload_layers in the
hook after the move (``on_fit_start``) or through the OffloadLayers callback."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hosts import require

from cpu_offload import offload_layers

pl = require("lightning.pytorch")
WIDTH, LAYERS, STEPS = 32, 4, 3


class Block(torch.nn.Module):
    """A layer with a buffer it saves for backward (as a RoPE cache or a mask is saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.scale


class Net(pl.LightningModule):
    """Four blocks; ``hook`` names the LightningModule hook that calls offload_layers."""

    def __init__(self, hook: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.hook = hook
        self.handle = None

    def _offload(self, hook: str) -> None:
        if self.hook == hook and self.handle is None:
            self.handle = offload_layers(self.layers, 2, min_offload_numel=0)

    def configure_model(self) -> None:
        self._offload("configure_model")

    def on_fit_start(self) -> None:
        self._offload("on_fit_start")

    def training_step(self, batch, index):
        (x,) = batch
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(net: Net, callbacks=(), precision: str = "32-true") -> Net:
    rows = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        precision=precision,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
        trainer.fit(net, data)
    return net


@functools.cache
def plain(precision: str = "32-true") -> Net:
    """The run without offloading, once per precision."""
    return fit(Net(), precision=precision)


def same_parameters(a: Net, b: Net) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


#: what offloading 2 layers moves per step: each layer's input and its tanh output
#: (batch 4 x 32 fp32, 512 bytes each); the buffer stays (it is marked)
MOVED = STEPS * 2 * 2 * 4 * WIDTH * 4


def test_offload_layers_in_on_fit_start_matches_a_run_without():
    net = fit(Net("on_fit_start"))
    assert same_parameters(net, plain())
    stats = net.handle.offload_synchronizer.stats
    assert stats.bytes_offloaded == stats.bytes_reloaded == MOVED
    net.handle.remove()


def test_the_callback_offloads_while_fitting_and_removes_its_hooks():
    from cpu_offload.integrations.lightning import OffloadLayers

    callback = OffloadLayers(2, min_offload_numel=0)
    net = fit(Net(), [callback])
    assert same_parameters(net, plain())
    assert callback.handle is None and callback.stats.bytes_offloaded == MOVED
    assert all(not layer._forward_hooks for layer in net.layers)
    assert "not fitting" in repr(callback)


@pytest.mark.parametrize("remark", [False, True], ids=["hooks only", "with the callback"])
def test_marks_follow_the_move_with_the_callback(remark):
    """64-bit precision converts the module after configure_model, as a move to the device
    would: the buffers are new tensors, and only the callback's marks are on them."""
    from cpu_offload.integrations.lightning import OffloadLayers

    net = fit(Net("configure_model"), [OffloadLayers()] if remark else [], precision="64-true")
    assert same_parameters(net, plain("64-true"))
    moved = net.handle.offload_synchronizer.stats.bytes_offloaded
    buffers = 0 if remark else STEPS * 2 * WIDTH * 8  # the 2 offloaded layers' scale
    assert moved == 2 * MOVED + buffers  # fp64
    net.handle.remove()


def test_the_callback_refuses_options_without_k_or_a_budget():
    from cpu_offload.integrations.lightning import OffloadLayers

    with pytest.raises(TypeError, match="need num_offloaded_layers"):
        OffloadLayers(min_offload_numel=0)
    with pytest.raises(TypeError, match="not both"):
        OffloadLayers(2, memory_budget="1GiB")
