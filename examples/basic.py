"""The README's usage example: offload 4 of 8 layers and check the gradients."""

import torch

from cpu_offload import get_cpu_offload_context

torch.manual_seed(0)
layers = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(8)]
ctx, sync_fn = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=8)

x0 = torch.randn(512, 1024, requires_grad=True)
x = x0
for layer in layers:
    with ctx:  # saved tensors of this layer may go to the host
        x = layer(x)
    x = sync_fn(x)  # backward reaching x prefetches earlier layers
x.sum().backward()
with_offload = [p.grad.clone() for layer in layers for p in layer.parameters()]

for layer in layers:
    layer.zero_grad()
x = x0
for layer in layers:
    x = layer(x)
x.sum().backward()
without = [p.grad for layer in layers for p in layer.parameters()]

stats = ctx.offload_synchronizer.stats
print(f"offloaded {stats.bytes_offloaded / 2**20:.1f} MiB in {stats.tensors_offloaded} tensors")
print("gradients bit-identical:", all(torch.equal(a, b) for a, b in zip(with_offload, without)))
