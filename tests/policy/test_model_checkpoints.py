"""A budget with the model's own gradient checkpointing (NOTE [A checkpoint the model
placed] in policy/model_checkpoints.py): each layer's recompute is measured and counted at
its backward, and the layer is not checkpointed a second time."""

from __future__ import annotations

import copy
import functools
import warnings

import torch
from helpers import modeled_device, tiny_hf_model
from torch.utils.checkpoint import checkpoint

from cpu_offload import offload_layers
from cpu_offload.plan.auto_policy import BY_THE_MODEL
from cpu_offload.policy.model_checkpoints import CountedCheckpoint
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda

TOKENS = torch.randint(0, 128, (4, 512), generator=torch.Generator().manual_seed(0))


def budgeted(checkpointed: bool, budget: str, steps: int = 2):
    """A tiny Llama (4 layers) under ``memory_budget=budget``, with transformers' gradient
    checkpointing or without; its measured layers, plan and gradients per step."""
    model = tiny_hf_model("Llama", 4)
    if checkpointed:
        model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache, and a budget nothing fits
        handle = offload_layers(model, memory_budget=budget, min_offload_numel=0)
        grads = []
        for _ in range(steps):
            torch.manual_seed(3)
            model(input_ids=TOKENS, labels=TOKENS).loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
    measured, plan = handle.auto.measured, handle.plan
    layer = model.model.layers[0]
    wrapped = isinstance(layer.__dict__.get("_gradient_checkpointing_func"), CountedCheckpoint)
    handle.remove()
    after = isinstance(layer.__dict__.get("_gradient_checkpointing_func"), CountedCheckpoint)
    return measured, plan, grads, (wrapped, after)


def test_the_recompute_of_the_models_checkpoint_is_measured_and_counted(capsys):
    plain, plain_plan, plain_grads, _ = budgeted(False, "400MiB")
    ours, plan, grads, (wrapped, after) = budgeted(True, "400MiB")
    assert checkpointed_layers_measured(plain, ours)
    assert wrapped and not after  # remove() gives the model its function back
    # the plan counts, at the last layer's backward, its recompute on top of the
    # checkpoints' inputs of every layer (all kept: the budget is loose)
    inputs = sum(r.saved_bytes for r in ours)
    assert plan.predicted.peak_bytes == inputs + ours[-1].recompute_bytes
    assert plain_plan.predicted.peak_bytes == sum(r.saved_bytes for r in plain)
    assert any(
        f"layers 0-3 (LlamaDecoderLayer): {BY_THE_MODEL}" in why for why in plan.checkpoint_refused
    )
    for expected, actual in zip(plain_grads, grads):
        assert all(torch.equal(a, b) for a, b in zip(expected, actual))


def test_a_copy_of_the_model_gets_its_own_checkpoint_function():
    model = tiny_hf_model("Llama", 2)
    model.gradient_checkpointing_enable()
    original = model.model.layers[0]._gradient_checkpointing_func
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = offload_layers(model, memory_budget="400MiB", min_offload_numel=0)
        model(input_ids=TOKENS, labels=TOKENS).loss.backward()  # measured: wrapped
    layer = model.model.layers[0]
    assert isinstance(layer.__dict__["_gradient_checkpointing_func"], CountedCheckpoint)
    copied = copy.deepcopy(layer)._gradient_checkpointing_func
    assert not isinstance(copied, CountedCheckpoint)
    assert copied.func is original.func and copied.keywords == original.keywords
    handle.remove()
    assert layer._gradient_checkpointing_func is original


def checkpointed_layers_measured(plain, ours) -> bool:
    """Each checkpointed layer saved its input, and its recompute the rest of what the
    plain layer saves."""
    return all(
        c.saved_bytes == p.input_bytes and c.saved_bytes + c.recompute_bytes == p.saved_bytes
        for p, c in zip(plain, ours)
    )


def test_a_budget_below_one_layers_recompute_says_nothing_fits():
    ours, plan, _, _ = budgeted(True, "4MiB")
    assert not plan.fits  # the case: 2 MiB of inputs, but ~8 MiB recomputed
    assert plan.predicted.peak_bytes > ours[-1].recompute_bytes > 4 * 2**20


H = 256
MIB = 2**20


class CheckpointedBlock(torch.nn.Module):
    """A block that checkpoints its own forward as transformers' layers do (through
    ``_gradient_checkpointing_func``); its recompute marks the modeled memory."""

    def __init__(self, marks: list) -> None:
        super().__init__()
        self.up = torch.nn.Linear(H, 4 * H, device="meta")
        self.down = torch.nn.Linear(4 * H, H, device="meta")
        self._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        self.marks = marks
        self.grad_out: list[torch.Tensor] = []

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.down(torch.nn.functional.gelu(self.up(x)))
        if torch._C._current_graph_task_id() != -1:  # the recompute, in backward
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.marks.append([out, *self.grad_out, *grads])  # not counted
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._gradient_checkpointing_func(self._forward, x)
        out.register_hook(self.grad_out.append)
        return out


def test_the_predicted_peak_is_the_modeled_peak_with_the_models_checkpoints():
    """On the modeled accelerator, the memory counted as the offloader counts it (layer
    outputs, incoming and parameter gradients left out) at each layer's end and at each
    recompute peaks where the plan says: the checkpoints' inputs plus the last layer's
    recompute (the budget keeps every layer)."""
    run_marks: list = []
    model = torch.nn.Sequential(*(CheckpointedBlock(run_marks) for _ in range(4)))
    others = [p for block in model for p in block.parameters()]
    x = torch.empty(4 * H, H, device="meta", requires_grad=True)  # outside the run
    peaks = []
    with timed_runtime(modeled_device()) as run, modeled_cuda(run.live):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = offload_layers(model, memory_budget="64MiB", min_offload_numel=0)
        for _ in range(3):
            counted = []
            for block in model:
                block.grad_out.clear()
            h = x.clone()  # as an embedding makes it
            for block in model:
                h = block(h)
                counted.append(run.mark("forward", [h]).counted)
            run_marks.clear()
            h.sum().backward()
            for not_counted in run_marks:
                grads = [p.grad for p in others if p.grad is not None]
                counted.append(run.mark("recompute", [*not_counted, *grads]).counted)
            peaks.append(max(counted))
            x.grad = None
            for p in others:
                p.grad = None
        plan, measured = handle.plan, handle.auto.measured
        handle.remove()
    assert plan.policy == ["keep"] * 4
    assert [r.recompute_bytes for r in measured] == [8 * MIB] * 4  # up's and gelu's outputs
    assert plan.predicted.peak_bytes == 4 * MIB + 8 * MIB == peaks[1] == peaks[2]
