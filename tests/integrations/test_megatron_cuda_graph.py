"""cpu_offload.integrations.megatron under CUDA graphs (issue 53), on a real Megatron-Core
GPTModel (CPU, gloo, world size 1) offloading through ``patch(cuda_graph=...)``.

The graphs are the modeled accelerator's, in its data mode (``timed_runtime(data=True)``,
NOTE [Data-mode replay]): a capture runs Megatron's Python once and records what its
streams were given, refusing what CUDA refuses; each replay runs the record again, with
no Python, on the strict simulator's streams.  The model is built inside the runtime (its
``TransformerBlock`` makes its offload context in ``__init__``).  Two shapes:

- a whole training step (forward, loss, backward) in one graph, after an eager warm-up
  step: what Megatron's full-iteration graphs capture (``patch(cuda_graph=True)``), also
  through Megatron's own ``forward_backward_no_pipelining`` schedule, the function its
  ``FullCudaGraphWrapper`` captures;
- per-layer graphs: each ``TransformerLayer``'s forward and backward graphed by torch's
  ``make_graphed_callables`` (``patch(cuda_graph="layer")``), the offload context entered
  inside each graphed callable.

Megatron's own switches refuse both with ``cpu_offloading=True`` on 0.16 (and the
per-layer ones on 0.19): the capture here is the training script's, as a
``torch.cuda.graph`` around the step (see docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_graph_steps import Moved, Replays, assert_replays_eager
from helpers import assert_bit_identical
from megatron_graphs import DEVICE, FLAVOUR_IDS, FLAVOURS, expected, model_and_loss, whole_step

from cpu_offload.graphs.graph_synchronizer import GRAPHED_OUTSIDE
from cpu_offload.integrations import megatron as megatron_offload
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.cuda_graphs import INVALIDATED, UNJOINED, UNSUPPORTED, CaptureError
from cpu_offload.testing.modeled_cuda import modeled_graph_calls


class _TorchOnTheCpu(types.ModuleType):
    """``torch`` as Megatron's schedules see it on a CPU: they count tokens in a tensor
    made with ``device="cuda"`` (on a GPU, under capture, from the graph's pool)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def megatrons_schedule(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """The step through Megatron's ``forward_backward_no_pipelining`` (one micro-batch):
    what its full-iteration graph captures.  The loss function does no host work (no
    ``validate_result``: :func:`test_megatrons_loss_check_inside_the_capture_is_refused`)."""
    from megatron.core.pipeline_parallel import schedules

    def forward_step(iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        tokens, positions, mask = next(iterator)
        output = model(tokens, positions, mask, labels=tokens)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = output.float().mean()
            return loss, {"lm loss": loss}

        return output, loss_func

    store = schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=[model],
        num_microbatches=1,
        seq_length=tokens_shape(batch)[1],
        micro_batch_size=tokens_shape(batch)[0],
        forward_only=False,
    )
    return store[0]["lm loss"]  # type: ignore[no-any-return]


def tokens_shape(batch: list[torch.Tensor]) -> tuple[int, int]:
    batch_size, sequence = batch[0].shape
    return batch_size, sequence


STEPS = {"model and loss": model_and_loss, "Megatron's schedule": megatrons_schedule}


@pytest.fixture
def step_on_the_cpu(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.setattr(schedules, "torch", _TorchOnTheCpu("torch"))


def patched_gpt(megatron: Any, cuda_graph: Any = True) -> Callable[[], tuple[Any, Any]]:
    """Builds the example's GPTModel offloading through ``patch(cuda_graph=...)``."""
    example, device = megatron

    def build() -> tuple[Any, Any]:
        with megatron_offload.patch(min_offload_numel=0, cuda_graph=cuda_graph):
            model = example.build(example.OFFLOADED, device)
        return model, model.decoder.offload_context

    return build


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("flavour", FLAVOURS, ids=FLAVOUR_IDS)
def test_a_whole_training_step_captured_replays_eager_values_and_bytes(
    megatron, step_on_the_cpu, flavour, step
):
    example, device = megatron
    data = example.batches(device, 3)
    want = expected(example.build(None, device), data, STEPS[step])
    found = whole_step(flavour, patched_gpt(megatron), STEPS[step], data)
    assert_replays_eager(found, want)
    assert found.report.cuda_graph.warmup_steps == 1


def test_megatrons_loss_check_inside_the_capture_is_refused(megatron, step_on_the_cpu):
    """Megatron's ``RerunStateMachine.validate_result`` (what Megatron-LM's loss functions
    call to reject a NaN loss) tests ``rejection_func(result)`` on the host: a host
    synchronisation, which a capture refuses.  Megatron's, not the offloader's: check
    the loss a replay leaves, after the replay."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    def checked(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        loss = model_and_loss(model, batch)
        get_rerun_state_machine().validate_result(
            result=loss, rejection_func=torch.isnan, message="loss is NaN"
        )
        return loss

    example, device = megatron
    with pytest.raises(CaptureError) as raised:
        whole_step("cuda", patched_gpt(megatron), checked, example.batches(device, 1))
    # refused where it waits (bool(torch.isnan(loss)): Tensor.item()), which invalidates
    # the capture; ending it (torch.cuda.graph's exit) then says so
    assert raised.value.kind == INVALIDATED
    cause = raised.value.__context__
    assert isinstance(cause, CaptureError) and cause.kind == UNSUPPORTED
    assert "the program called Tensor.item() while side stream" in str(cause)


class InContext(torch.nn.Module):
    """A ``TransformerLayer`` with the block's offload context entered inside: what a
    per-layer graph must hold (the block enters it around the layer's call, outside
    any graph of the layer).  ``inside=False``: the layer alone, as Megatron graphs it."""

    def __init__(self, layer: torch.nn.Module, block: torch.nn.Module, inside: bool) -> None:
        super().__init__()
        self.layer = layer
        self.ctx, self.commit = block.offload_context, block.group_prefetch_offload_commit_async
        if not inside:
            self.ctx, self.commit = contextlib.nullcontext(), lambda output: output

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        rotary_pos_emb: torch.Tensor,
    ) -> torch.Tensor:
        with self.ctx:
            output, _ = self.layer(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
            )
        return self.commit(output)  # type: ignore[no-any-return]


class GraphedLayer(torch.nn.Module):
    """A graphed layer where the block's loop calls a ``TransformerLayer`` (keywords
    in, ``(hidden_states, context)`` out), as Megatron's ``_te_cuda_graph_replay`` is."""

    def __init__(self, graphed: Callable) -> None:
        super().__init__()
        self.graphed = graphed

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        context: Any = None,
        rotary_pos_emb: Any = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, Any]:
        return self.graphed(hidden_states, attention_mask, rotary_pos_emb), context


def per_layer(
    megatron: Any, flavour: str, data: list, scope: Any = "layer", inside: bool = True
) -> Replays:
    """An eager warm-up step through the block's own loop, then every layer's forward
    and backward captured by ``make_graphed_callables`` and a step per batch through
    the graphed layers (in the block's loop, which enters the context around them when
    not ``inside``)."""
    example, device = megatron
    found = Replays()
    arguments: dict[str, Any] = {}
    with timed_runtime(DEVICE, flavour=flavour, data=True) as run, modeled_graph_calls(run.live):
        live = run.live
        with megatron_offload.patch(min_offload_numel=0, cuda_graph=scope):
            model = example.build(example.OFFLOADED, device)
        block = model.decoder

        def step(batch: list[torch.Tensor]) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            loss = model_and_loss(model, batch)
            # (cloned: the parameters' gradients are the backward graphs' static outputs)
            return [loss.detach().clone(), *(p.grad.clone() for p in model.parameters())]

        hook = block.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: arguments.update(kwargs), with_kwargs=True
        )
        moved = Moved(live)
        values = step(data[0])
        found.eager = moved.since(), values
        hook.remove()
        callables = tuple(InContext(layer, block, inside) for layer in block.layers)
        reports = block.offload_context
        hidden = arguments["hidden_states"]
        samples = tuple(
            (
                torch.zeros_like(hidden).requires_grad_(),
                arguments["attention_mask"],
                arguments["rotary_pos_emb"],
            )
            for _ in callables
        )
        graphed = torch.cuda.make_graphed_callables(callables, samples, num_warmup_iters=0)
        if inside:  # the context runs inside each layer's graphs; the block's loop enters none
            block.offload_context = contextlib.nullcontext()
            block.group_prefetch_offload_commit_async = None
        block.layers = torch.nn.ModuleList(GraphedLayer(g) for g in graphed)
        for batch in data:
            moved = Moved(live)
            values = step(batch)
            found.replays.append((moved.since(), values))
        found.report = reports.report()
    found.hazards = live.strict.counters.hazards
    return found


@pytest.mark.parametrize("flavour", FLAVOURS, ids=FLAVOUR_IDS)
def test_per_layer_graphs_of_megatrons_layers_replay_eager_values_and_bytes(megatron, flavour):
    example, device = megatron
    data = example.batches(device, 3)
    want = expected(example.build(None, device), data, model_and_loss)
    found = per_layer(megatron, flavour, data)
    assert_replays_eager(found, want)


def test_the_blocks_context_around_graphed_layers_moves_nothing(megatron):
    """Graphed as Megatron graphs them (the layer alone, its block entering the context
    around the graphed call), a layer saves nothing for its backward that the context
    sees: its activations stay in the graph's memory.  Replays compute eager's values
    and move nothing, the report shows no captured step, and one warning says why and
    that the context goes inside each graphed callable (docs/megatron.md)."""
    example, device = megatron
    data = example.batches(device, 3)
    want = expected(example.build(None, device), data, model_and_loss)
    with pytest.warns(UserWarning) as warned:
        found = per_layer(megatron, "cuda", data, inside=False)
    said = [str(w.message) for w in warned if "cuda_graph=" in str(w.message)]
    assert said == [GRAPHED_OUTSIDE]  # once, not silently
    assert found.eager is not None and found.eager[0][0] > 0  # the warm-up step offloads
    for (moved, values), wanted in zip(found.replays, want):
        assert moved == (0, 0)
        assert_bit_identical(wanted, values)
    steps = found.report.cuda_graph
    assert (steps.captured, steps.warmup_steps) == (False, 1 + len(data))


def test_the_whole_step_schedule_under_per_layer_graphs_fails_with_cudas_error(megatron):
    """``patch(cuda_graph=True)`` leaves a layer's offload for a later graph to join:
    the first layer's graph ends unjoined (CUDA's error), never a silent wrong replay."""
    example, device = megatron
    with pytest.raises(CaptureError) as raised:
        per_layer(megatron, "cuda", example.batches(device, 1), scope=True)
    assert raised.value.kind == UNJOINED


def test_megatrons_own_graph_switches_and_cpu_offloading(megatron):
    """Megatron's ``TransformerConfig`` refuses its per-layer graphs (``local``,
    ``transformer_engine``) with ``cpu_offloading=True``; 0.16 also its full-iteration
    graphs (``local`` with scope ``full_iteration``), which 0.19 accepts
    (``cuda_graph_impl="full_iteration"``)."""
    from megatron.core import __version__
    from megatron.core.transformer.transformer_config import TransformerConfig
    from packaging.version import Version

    settings = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
    )
    for impl in ("local", "transformer_engine"):
        with pytest.raises(ValueError, match="CUDA graphs not supported with CPU offloading"):
            TransformerConfig(**settings, cuda_graph_impl=impl)
    if Version(__version__) >= Version("0.19"):
        config = TransformerConfig(**settings, cuda_graph_impl="full_iteration")
        assert config.cuda_graph_impl == "full_iteration" and config.cpu_offloading
    else:
        with pytest.raises(ValueError, match="CUDA graphs not supported with CPU offloading"):
            TransformerConfig(
                **settings, cuda_graph_impl="local", cuda_graph_scope="full_iteration"
            )
