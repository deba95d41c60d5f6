"""A real Megatron-Core GPTModel offloading with cpu-offload, with or without TransformerEngine.

    pip install "cpu-offload[megatron]"
    python examples/megatron_gpt.py

`cpu_offload.integrations.megatron.patch()` goes before the model is built; then
Megatron's own `cpu_offloading=True, cpu_offloading_num_layers=k` config switches work.
Two training steps run with offloading and two without, and the gradients are compared.

Megatron-Core assumes CUDA. On a machine without a GPU, `cpu_harness()` replaces its two
CUDA-only helpers (the current CUDA device, the CUDA RNG tracker) so that the same model
trains on the CPU; this is for trying the example anywhere, not part of the integration.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from cpu_offload.device.runtime import available_device_type
from cpu_offload.integrations import megatron as megatron_offload

LAYERS, OFFLOADED, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 4, 2, 64, 4, 32, 2, 128


def cpu_harness(set_attribute: Callable[[object, str, object], None] = setattr) -> None:
    """Let Megatron-Core run on the CPU: its buffers use the current CUDA device, and its
    attention forks the CUDA RNG tracker.  (Tests pass ``monkeypatch.setattr``.)"""
    from megatron.core import tensor_parallel

    tracker = types.SimpleNamespace(
        fork=lambda name=None: contextlib.nullcontext(), is_initialized=lambda: True
    )
    set_attribute(torch.cuda, "current_device", lambda: "cpu")
    for module in (tensor_parallel, tensor_parallel.random):
        set_attribute(module, "get_cuda_rng_tracker", lambda *args, **kwargs: tracker)


def initialize(set_attribute: Callable[[object, str, object], None] = setattr) -> torch.device:
    """One process, tensor and pipeline parallel size 1 (gloo on the CPU, nccl on GPUs)."""
    from megatron.core import parallel_state

    device_type = available_device_type()
    if device_type == "cpu":
        cpu_harness(set_attribute)
    if not dist.is_initialized():  # one process: an in-memory store, no port
        backend = "gloo" if device_type == "cpu" else "nccl"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return torch.device(device_type)


def build(offloaded: int | None, device: torch.device) -> torch.nn.Module:
    """A small Llama-like GPTModel (local layer spec: no TransformerEngine needed)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        gated_linear_unit=True,  # SwiGLU
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        cpu_offloading=offloaded is not None,
        cpu_offloading_num_layers=offloaded or 0,
    )
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return model.to(device)


def batches(device: torch.device, steps: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)
        positions = torch.arange(SEQ, device=device).expand(BATCH, -1)
        mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device).triu(1)
        out.append((tokens, positions, mask))
    return out


def train(model: torch.nn.Module, data: list) -> list[list[torch.Tensor]]:
    """Plain SGD steps; the gradients of every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients = []
    for tokens, positions, mask in data:
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, positions, mask, labels=tokens).float().mean()
        loss.backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return gradients


def main(steps: int = 2) -> bool:
    device = initialize()
    data = batches(device, steps)
    expected = train(build(None, device), data)
    with megatron_offload.patch(min_offload_numel=0):  # before the model is built
        model = build(OFFLOADED, device)
    actual = train(model, data)
    context = model.decoder.offload_context
    moved = context.offload_synchronizer.stats.bytes_offloaded / steps
    same = all(torch.equal(a, b) for e, o in zip(expected, actual) for a, b in zip(e, o))
    print(
        f"megatron-core GPTModel on {device}: layers={LAYERS} offloaded={OFFLOADED} "
        f"steps={steps}: {moved / 2**20:.2f} MiB offloaded per step, "
        f"gradients bit-identical: {same}"
    )
    return same


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's "TE / Apex not installed" notices
        ok = main()
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)
