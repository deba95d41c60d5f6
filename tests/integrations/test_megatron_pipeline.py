"""``offload_layers(memory_budget=...)`` inside a real Megatron-Core pipeline stage: two
processes (gloo, CPU) run Megatron's own 1F1B schedule
(``forward_backward_pipelining_without_interleaving``) over a GPTModel split in two, and
each rank's offloader plans for the passes its stage keeps in flight."""

from __future__ import annotations

import contextlib
import json
import re
import types
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import load_example
from hosts import require

ROOT = Path(__file__).resolve().parents[2]
MICROBATCHES, SEQ, BATCH = 4, 32, 2


class _TorchOnTheCpu(types.ModuleType):
    """``torch`` as Megatron's schedules see it on a CPU: its 1F1B schedule counts tokens
    in a tensor it makes with ``device="cuda"``, made on the CPU here."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _stage(rank: int, world: int, store: str, out: str) -> None:
    """One rank: Megatron's 1F1B without offload, then two steps with offload_layers on
    the stage's decoder layers under a memory budget; what it saw, as JSON."""
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    example = load_example("megatron_gpt")
    example.cpu_harness()  # the current CUDA device and RNG tracker, on the CPU
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cpu_offload import offload_layers

    schedules.torch = _TorchOnTheCpu("torch")
    parallel_state.initialize_model_parallel(1, world)
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, pipeline_model_parallel_size=world,
        pipeline_dtype=torch.float32, batch_p2p_sync=False,  # no torch.cuda.synchronize
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=example.VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )  # fmt: skip

    def step() -> list[torch.Tensor]:
        data = iter(example.batches(torch.device("cpu"), MICROBATCHES))

        def forward_step(iterator, model):
            tokens, positions, mask = next(iterator)
            output = model(tokens, positions, mask, labels=tokens)
            return output, lambda o: (o.float().mean(), {})

        model.zero_grad(set_to_none=True)
        schedules.get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[model],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
        return [p.grad.clone() for p in model.parameters()]

    expected = step()
    handle = offload_layers(model.decoder.layers, memory_budget="1MiB", min_offload_numel=0)
    with contextlib.redirect_stdout(None):
        actual = [step(), step()]  # the first measured, the second planned
    plan, stats = handle.plan, handle.offload_synchronizer.stats
    seen = {
        "rank": rank,
        "layers": len(model.decoder.layers),
        "in_flight": plan.in_flight,
        "runs": plan.runs(),
        "bit_identical": all(
            torch.equal(a, b) for grads in actual for a, b in zip(expected, grads, strict=True)
        ),
        "forward_passes": stats.forward_passes,
        "on_demand_reloads": stats.on_demand_reloads,
    }
    handle.remove()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_offload_layers_plans_each_megatron_pipeline_stage_for_its_passes(tmp_path):
    """1F1B over 2 ranks with 4 micro-batches: rank 0 keeps 2 passes in flight, rank 1 one;
    each plans for its own (the first step measured with every pass in flight), and both
    compute Megatron's gradients bit for bit."""
    require("megatron.core")
    torch.multiprocessing.spawn(
        _stage, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["layers"] for r in ranks] == [2, 2]  # Megatron split the 4 layers
    assert [r["in_flight"] for r in ranks] == [2, 1]
    # planned for its 2 passes: all kept per layer, or some moved whole (keep_passes)
    assert re.search(
        r"(every pass of 2 in flight|keep 1 pass, 1 of 2 moved whole)$", ranks[0]["runs"]
    )
    assert "in flight" not in ranks[1]["runs"]
    assert all(r["bit_identical"] for r in ranks)
    assert [r["forward_passes"] for r in ranks] == [2 * MICROBATCHES] * 2
    assert all(r["on_demand_reloads"] == 0 for r in ranks)
