"""A transformer block written the way Megatron-Core writes its TransformerBlock.

The only change from Megatron's code is the import line:

    from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context  # before
    from cpu_offload import get_cpu_offload_context                             # after

Run it: ``python examples/megatron_style.py`` trains a few steps with offloading on and
off and checks that the gradients are bit-identical at every step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

from cpu_offload import get_cpu_offload_context
from cpu_offload.device.runtime import get_backend
from cpu_offload.models.llama import LlamaConfig, LlamaLayer


@dataclass
class TransformerConfig:
    """The fields Megatron-Core's TransformerConfig uses for CPU offloading."""

    num_layers: int = 6
    hidden_size: int = 128
    num_attention_heads: int = 8
    num_query_groups: int = 2
    ffn_hidden_size: int = 256
    cpu_offloading: bool = True
    cpu_offloading_num_layers: int = 3
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        layer_config = LlamaConfig(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_query_groups,
            ffn=config.ffn_hidden_size,
        )
        self.layers = nn.ModuleList(LlamaLayer(layer_config) for _ in range(config.num_layers))
        if self.config.cpu_offloading:
            # As in Megatron-Core: created once, arguments passed positionally.
            (self.offload_context, self.group_prefetch_offload_commit_async) = (
                get_cpu_offload_context(
                    self.config.cpu_offloading,
                    self.config.cpu_offloading_num_layers,
                    self.config.num_layers,
                    self.config.cpu_offloading_activations,
                    self.config.cpu_offloading_weights,
                    self.config.cpu_offloading_double_buffering,
                )
            )
        else:
            self.offload_context = contextlib.nullcontext()
            self.group_prefetch_offload_commit_async = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with self.offload_context:
                hidden_states = layer(hidden_states)
            if (
                torch.is_grad_enabled()
                and self.config.cpu_offloading
                and self.group_prefetch_offload_commit_async is not None
            ):
                hidden_states = self.group_prefetch_offload_commit_async(hidden_states)
        return hidden_states


def train(block: TransformerBlock, batches, steps_lr: float = 1e-2):
    """SGD steps; the gradients of every step."""
    optimizer = torch.optim.SGD(block.parameters(), lr=steps_lr)
    gradients = []
    for x, target in batches:
        optimizer.zero_grad(set_to_none=True)
        (block(x) - target).square().mean().backward()
        gradients.append([p.grad.clone() for p in block.parameters()])
        optimizer.step()
    return gradients


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    device = get_backend().device
    config = TransformerConfig()
    torch.manual_seed(0)
    reference = TransformerBlock(TransformerConfig(cpu_offloading=False)).to(device)
    offloaded = TransformerBlock(config).to(device)
    offloaded.load_state_dict(copy.deepcopy(reference.state_dict()))
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq, config.hidden_size)
    batches = [
        (
            torch.randn(shape, generator=generator).to(device),
            torch.randn(shape, generator=generator).to(device),
        )
        for _ in range(args.steps)
    ]
    expected = train(reference, batches)
    actual = train(offloaded, batches)
    same = all(
        torch.equal(a, b)
        for step_a, step_b in zip(expected, actual)
        for a, b in zip(step_a, step_b)
    )
    stats = offloaded.offload_context.offload_synchronizer.stats
    print(
        f"device={device} layers={config.num_layers} offloaded={config.cpu_offloading_num_layers} "
        f"steps={args.steps}: {stats.bytes_offloaded / 2**20:.1f} MiB offloaded, "
        f"gradients bit-identical: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
