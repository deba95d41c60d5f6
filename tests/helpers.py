"""Models and training loops shared by the tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hosts import require
from torch import nn

from cpu_offload import OffloadableLayerState, get_cpu_offload_context
from cpu_offload.models.gpt import Block


class MLPBlock(nn.Module):
    def __init__(self, width: int, factor: int = 2, device: Any = None) -> None:
        super().__init__()
        self.up = nn.Linear(width, factor * width, device=device)
        self.down = nn.Linear(factor * width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


#: emulated pipeline orders of one stage: F<i> the forward of micro-batch i, B<i> its backward
PIPELINE_ORDERS = {
    "1f1b": "F0 F1 F2 B0 F3 B1 B2 B3",
    "1f1b-deep": "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
    "gpipe": "F0 F1 F2 F3 B0 B1 B2 B3",
    "reverse": "F0 F1 F2 F3 B3 B2 B1 B0",
    "interleaved": "F0 F1 B1 F2 B0 F3 B3 B2",
    "one-at-a-time": "F0 B0 F1 B1 F2 B2",
}

#: emulated orders of one stage with the backward split (zero-bubble schedules, ZB-V):
#: I<i> micro-batch i's input gradients (torch's ``stage_backward_input``), W<i> its
#: weight gradients, later (``stage_backward_weight``)
SPLIT_ORDERS = {
    "zbv": "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
    "zbv-cooldown": "F0 F1 I0 F2 I1 W0 I2 W1 W2",
    "zbv-deferred": "F0 F1 F2 I0 I1 I2 W0 W1 W2",
    "split-reverse": "F0 F1 F2 I2 W2 I1 I0 W0 W1",
}


def run_pipeline_order(
    layers: nn.ModuleList, order: str, k: int | None, **options: Any
) -> tuple[list[torch.Tensor], Any]:
    """The gradients after one of ``PIPELINE_ORDERS`` (or ``SPLIT_ORDERS``) on MLP layers
    of width 32, and the context (None without offload: ``k=None``); ``options`` go to
    the context."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from cpu_offload import get_cpu_offload_context

    layers.zero_grad(set_to_none=True)
    ctx = sync_fn = None
    if k is not None:
        ctx, sync_fn = get_cpu_offload_context(True, k, len(layers), min_offload_numel=0, **options)
    outputs, inputs, groups = {}, {}, {}
    for step in order.split():
        micro = int(step[1:])
        if step[0] == "F":
            x = inputs[micro] = make_input("mlp", 32, torch.float32, seed=micro).requires_grad_()
            outputs[micro] = forward(layers, x, ctx, sync_fn)
        elif step[0] == "B":
            outputs.pop(micro).square().mean().backward()
        elif step[0] == "I":  # as torch's zero-bubble schedules split a backward
            loss = outputs.pop(micro).square().mean()
            x, params = inputs[micro], layers.parameters()
            groups[micro] = stage_backward_input([loss], None, [x], params)[1]
        else:
            stage_backward_weight(layers.parameters(), groups.pop(micro))
    return [p.grad.clone() for p in layers.parameters()], ctx


def load_example(name: str) -> Any:
    """The module ``examples/<name>.py``, loaded as ``name`` (registered in ``sys.modules``
    for the dataclasses it defines)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def modeled_device(link_bytes_per_s: float = 1e9, host_issue_s: float = 2e-6) -> Any:
    """The small device the modeled accelerator's tests run on (1 GB/s: 1 MiB in ~1 ms)."""
    from cpu_offload.device.profiles import DeviceProfile

    return DeviceProfile(
        link_bytes_per_s=link_bytes_per_s,
        flops_per_s=1e12,
        memory_bytes_per_s=1e11,
        launch_s=1e-6,
        host_issue_s=host_issue_s,
        name="test device",
    )


def make_layers(kind: str, num_layers: int, width: int, dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    if kind == "mlp":
        layers = [MLPBlock(width) for _ in range(num_layers)]
    else:
        layers = [Block(width, heads=4) for _ in range(num_layers)]
    return nn.ModuleList(layers).to(dtype)


def make_input(kind: str, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (16, width) if kind == "mlp" else (2, 16, width)
    return torch.randn(shape, generator=generator).to(dtype)


def forward(
    layers: Sequence[nn.Module], x: torch.Tensor, ctx: Any = None, sync_fn: Callable | None = None
) -> torch.Tensor:
    for layer in layers:
        if ctx is None:
            x = layer(x)
        else:
            with ctx:
                x = layer(x)
            x = sync_fn(x)
    return x


def gradients(
    layers: nn.ModuleList,
    kind: str,
    width: int,
    dtype: torch.dtype,
    *,
    offloaded: int | None,
    iterations: int = 3,
    micro_batches: int = 1,
    min_offload_numel: int = 0,
) -> list[torch.Tensor]:
    """Parameter gradients after ``iterations`` steps (no optimizer), each step
    accumulating over ``micro_batches``; ``offloaded=None`` runs without offload."""
    ctx = sync_fn = None
    if offloaded is not None:
        ctx, sync_fn = get_cpu_offload_context(
            True, offloaded, len(layers), min_offload_numel=min_offload_numel
        )
    results = []
    for step in range(iterations):
        layers.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            x = make_input(kind, width, dtype, seed=100 * step + micro).requires_grad_()
            out = forward(layers, x, ctx, sync_fn)
            (out.float().square().mean() / micro_batches).backward()
        results.extend(p.grad.clone() for p in layers.parameters())
    return results


def assert_bit_identical(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    assert len(expected) == len(actual)
    for index, (a, b) in enumerate(zip(expected, actual)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        assert torch.equal(a, b), f"gradient {index} differs (max abs diff {(a - b).abs().max()})"


def without_event_waits(monkeypatch, method_name):
    """Plant a bug: ``OffloadableLayerState.<method_name>`` skips every event wait."""
    original = getattr(OffloadableLayerState, method_name)

    def buggy(self, *args):
        with monkeypatch.context() as patch:
            patch.setattr(self.backend, "wait_event", lambda stream, event: None)
            return original(self, *args)

    monkeypatch.setattr(OffloadableLayerState, method_name, buggy)


def torchrun(script: str, processes: int, *args: str) -> str:
    """Run ``examples/<script>`` on ``processes`` local processes; its output (it must
    exit with 0)."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(processes), str(root / "examples" / script), *args],
        capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


def small_llama_config(transformers: Any, path: Path) -> Any:
    """A 4-layer Hugging Face ``LlamaConfig`` (hidden 256, 4/2 heads), saved to ``path``."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config.save_pretrained(path)
    return config


#: the vocabulary of :func:`tiny_hf_model`'s models, and of the tokens fed to them
HF_VOCAB = 128

#: what a family's config needs besides the shared shapes (a mixture: 4 experts, top 2)
_HF_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "Mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def tiny_hf_model(family: str = "Llama", layers: int = 4, **fields: Any) -> Any:
    """A tiny Hugging Face ``<family>ForCausalLM`` (``"Llama"``, ``"Mixtral"``,
    ``"Qwen2"``): vocabulary 128, hidden 64, ffn 128, 4/2 heads, ``layers`` layers and
    any other config ``fields``; its weights drawn after ``torch.manual_seed(0)``."""
    transformers = require("transformers")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **{**_HF_FAMILY_FIELDS.get(family, {}), **fields},
    )
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


class Tokens(torch.utils.data.Dataset):
    """``count`` rows of ``length`` random tokens (seeded), each its own labels: a
    Hugging Face Trainer's data set."""

    def __init__(self, count: int, length: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, HF_VOCAB, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def trainer_args(output_dir: Path, **fields: Any) -> Any:
    """``TrainingArguments`` of a short, quiet, seeded run on the CPU (2 steps of batch 2,
    nothing saved or reported), with ``fields`` added or replaced."""
    transformers = require("transformers")
    defaults: dict[str, Any] = dict(
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    return transformers.TrainingArguments(output_dir=str(output_dir), **{**defaults, **fields})


def tiny_preset_run(min_numel: int) -> tuple[Any, Any, Any]:
    """The planner's ``tiny`` preset layer measured at ``min_numel``, a 4-layer model of
    that layer, and tokens of the preset's batch 2 and sequence 512."""
    from cpu_offload.models.llama import Llama, LlamaConfig
    from cpu_offload.plan import measure_layer
    from cpu_offload.plan.layers import preset_layer

    spec = preset_layer("tiny")
    layer = measure_layer(
        spec.make_layer, spec.inputs, min_offload_numel=min_numel, attention="cpu"
    )
    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden=256, heads=4, kv_heads=2, ffn=688, layers=4))
    tokens = torch.randint(0, 1024, (2, 513))
    return layer, model, tokens


def saved_bytes_per_layer(model: torch.nn.Module, data: list) -> list[int]:
    """Bytes of the non-parameter storages each layer of a Megatron-Core model's
    ``decoder.layers`` saves for backward in one step on ``data[0]``."""
    seen: list[dict[int, int]] = []

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        if not isinstance(base, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            seen[-1][storage.data_ptr()] = storage.nbytes()
        return tensor

    def pre(module, args, kwargs):
        seen.append({})
        module._census = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        module._census.__enter__()

    def post(module, args, kwargs, output):
        module._census.__exit__(None, None, None)

    hooks = []
    for layer in model.decoder.layers:
        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(post, with_kwargs=True))
    tokens, positions, mask = data[0]
    model(tokens, positions, mask, labels=tokens).float().mean().backward()
    for hook in hooks:
        hook.remove()
    return [sum(layer.values()) for layer in seen]


def offload_in_order(
    model: torch.nn.Module, order: str, prepare: Any, k: int, **options: Any
) -> Any:
    """``offload_layers(model, k, min_offload_numel=0, **options)`` before
    ``prepare(model)`` (which compiles its blocks) when ``order`` is ``"offload first"``,
    after it otherwise; the handle."""
    from cpu_offload import offload_layers

    if order == "offload first":
        handle = offload_layers(model, k, min_offload_numel=0, **options)
        prepare(model)
        return handle
    prepare(model)
    return offload_layers(model, k, min_offload_numel=0, **options)
