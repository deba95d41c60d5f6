"""The modeled ``torch.cuda`` (NOTE [Modeled cuda]): programs written for a GPU, the peers'
installed classes among them, run unmodified on the modeled accelerator."""

from __future__ import annotations

import pytest
import torch
from helpers import modeled_device

from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda

DEVICE = modeled_device()
H = 512
UNIT = H * H * 4  # one weight; an activation of 2H rows is two


def step(hooks, layers=2):
    """Linear and ReLU layers of width H on 2H rows, forward under ``hooks()``, backward."""
    stack = [torch.nn.Linear(H, H, device="meta") for _ in range(layers)]
    x = torch.empty(2 * H, H, device="meta", requires_grad=True)
    with hooks():
        h = x
        for layer in stack:
            h = layer(h).relu()
    h.sum().backward()
    return x


def test_the_stream_api_is_the_models_and_copies_are_counted():
    x = torch.empty(1024, 1024, device="meta")
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        assert torch.cuda.is_available() and torch.cuda.default_stream() is run.live.compute
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
            host = torch.empty_like(x, device="cpu", pin_memory=True)
            host.copy_(x, non_blocking=True)
        done = side.record_event()
        torch.cuda.current_stream().wait_event(done)
        back = host.to("cuda", non_blocking=True)
        again = back.to("cuda")  # already there: no copy
        made = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        devices = [t.device.type for t in (x, host, back, made)]
        assert back.is_meta and not host.is_cuda and back.is_cuda
    assert devices == ["cuda", "cpu", "cuda", "cuda"] and again is back
    assert run.d2h_bytes == run.h2d_bytes == 4 * 2**20
    assert run.host_peak_bytes == 4 * 2**20
    # the compute stream waited for the side stream's copy, then ran its own
    copy_s = 4 * 2**20 / DEVICE.link_bytes_per_s
    assert run.exposed_copy_s == pytest.approx(2 * copy_s, rel=0.05)


def test_torch_cuda_and_tensors_are_themselves_again_after_the_block():
    stream = torch.cuda.Stream
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        assert torch.cuda.Stream is not stream
    assert torch.cuda.Stream is stream
    assert torch.empty(1, device="meta").device.type == "meta"
    assert "device" not in torch.Tensor.__dict__ and "to" not in torch.Tensor.__dict__
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
        torch.empty(1, device="cuda")


def test_a_value_read_from_the_device_waits_and_only_truth_values_read():
    x = torch.empty(8, device="meta")
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        assert bool((x > 0).all()) is True
        with pytest.raises(RuntimeError, match="reads a torch.float32 value from the device"):
            x.sum().item()
    assert run.host_syncs == 2


def test_the_data_mode_is_refused_with_the_reason():
    with timed_runtime(DEVICE, data=True) as run:
        with pytest.raises(ValueError, match="modeled cuda runs shapes only"):
            with modeled_cuda(run.live):
                pass


def test_save_on_cpu_moves_every_saved_tensor_pinned():
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        step(lambda: torch.autograd.graph.save_on_cpu(pin_memory=True, device_type="cuda"))
    # per layer: its input and ReLU's output (2 units each), the weight's transpose (1)
    assert run.d2h_bytes == run.h2d_bytes == 2 * 5 * UNIT
    assert run.host_syncs == 0  # pinned: no copy holds the host
    assert run.host_peak_bytes == 2 * 5 * UNIT


@pytest.mark.parametrize(
    "module",
    ["torchtune.training._activation_offloading", "trl.models.activation_offloading"],
)
def test_a_peers_offload_activations_runs_unmodified_and_moves_bytes(module):
    offload = pytest.importorskip(module).OffloadActivations
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        step(lambda: offload(max_fwd_stash_size=1))
    # what save_on_cpu moves (parameters are not saved as such: the transposes are views)
    assert run.d2h_bytes == 2 * 5 * UNIT
    # the last saved tensor is still stashed on the device when backward begins
    assert run.h2d_bytes == run.d2h_bytes - 2 * UNIT
    assert run.exposed_copy_s > 0 and run.host_syncs == 0


def test_tensor_constructors_on_cuda_are_meta_underneath():
    with timed_runtime(DEVICE) as run, modeled_cuda(run.live):
        made = [torch.tensor([], device="cuda"), torch.as_tensor([1.0, 2.0], device="cuda")]
        assert [t.device.type for t in made] == ["cuda", "cuda"]
    assert all(t.is_meta for t in made) and made[1].shape == (2,)
