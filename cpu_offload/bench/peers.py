"""``--simulate PROFILE --modes none,checkpoint,save_on_cpu,hf_offload,torchtune,trl``: the
peers' own code on the modeled accelerator, and ours beside each at that peer's memory.

NOTE [Peers on the modeled accelerator]
    Each peer runs one training step of the preset's stack, unmodified, inside
    ``timed_runtime`` with the modeled ``torch.cuda`` (NOTE [Modeled cuda]): its streams,
    events, pinned buffers and ``.to("cuda", non_blocking=True)`` are the model's, so its
    step time, exposed copy time, copies and memory come from the same clocks and
    allocator count as ours.  The peers' classes are imported from their installed
    packages (the ``peers`` extra); one that does not import is a row with its reason.

    Beside each peer row, ours: the policy the planner chooses for that row's peak (the
    model's allocator peak, everything counted), run on the same model with the same
    stack and loss.  The planner's budget covers saved activations only, so the budget
    starts at the peer's peak less what the stack holds besides (the modeled peak
    without offload less the planner's), and tightens by what ours overshot until ours
    fits under the peer's peak.  ``hf_offload`` runs transformers' own Llama decoder
    stack, and ours beside it runs on that stack too (``offload_layers`` on its ``layers``,
    unmodified); the planner's census is of the benchmark's Llama layer of the same shapes.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

from ..layer_hooks import offload_layers
from ..plan.census import LayerProfile
from ..plan.planner import plan_offload
from ..plan.policy_search import choose_policy
from ..report.policy_words import policy_runs
from ..testing import TimedReport, TimedRuntime, timed_runtime
from ..testing.modeled_cuda import modeled_cuda
from .config import BenchConfig
from .simulate import modeled_step, stack_of

__all__ = ["PEERS", "PeerRow", "hf_ours_step", "hf_stack", "ours_at", "peer_step", "run_peers"]

GIB = 2**30
#: budgets :func:`ours_at` tries before its last, the least memory it can ask for
TRIES = 5
#: the slices ours may reload an offloaded layer in (one hidden state of the 8k preset;
#: NOTE [Reloading a layer in slices]): the planner chooses whether to
SLICE_BYTES = 64 * 2**20
Forward = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _plain(stack: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    for layer in stack:  # type: ignore[attr-defined]
        h = layer(h)
    return h


def _checkpoint(stack: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    for layer in stack:  # type: ignore[attr-defined]
        h = checkpoint(layer, h, use_reentrant=False)
    return h


def _save_on_cpu(stack: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu(pin_memory=True, device_type="cuda"):
        return _plain(stack, h)


def _offload_activations(module: str) -> Forward:
    def forward(stack: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        offload = importlib.import_module(module).OffloadActivations
        with offload():  # their defaults: pinned memory, a side stream
            return _plain(stack, h)

    return forward


def _hf_offload(stack: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    stack.activation_checkpointing_enable(offload=True)  # type: ignore[operator]
    return stack(inputs_embeds=h).last_hidden_state  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Peer:
    """A peer: what runs (``code``), the module to import, and its forward."""

    code: str
    module: str
    forward: Forward


#: the modes of the side-by-side, and the code each runs
PEERS: dict[str, Peer] = {
    "none": Peer("autograd, activations kept", "torch", _plain),
    "checkpoint": Peer(
        "torch.utils.checkpoint.checkpoint(use_reentrant=False), every layer",
        "torch.utils.checkpoint",
        _checkpoint,
    ),
    "save_on_cpu": Peer(
        "torch.autograd.graph.save_on_cpu(pin_memory=True)", "torch.autograd.graph", _save_on_cpu
    ),
    "hf_offload": Peer(
        "transformers.LlamaModel.activation_checkpointing_enable(offload=True)",
        "transformers",
        _hf_offload,
    ),
    "torchtune": Peer(
        "torchtune.training._activation_offloading.OffloadActivations",
        "torchtune.training._activation_offloading",
        _offload_activations("torchtune.training._activation_offloading"),
    ),
    "trl": Peer(
        "trl.models.activation_offloading.OffloadActivations",
        "trl.models.activation_offloading",
        _offload_activations("trl.models.activation_offloading"),
    ),
}


def hf_stack(config: BenchConfig) -> torch.nn.Module:
    """transformers' Llama decoder stack of the preset's shapes, on the meta device,
    training (the ``hf_offload`` row's model)."""
    from transformers import LlamaConfig, LlamaModel

    shape = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=256,  # the step feeds embeddings: the table is never read
        hidden_size=config.hidden,
        intermediate_size=config.ffn,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.seq,
        attn_implementation="sdpa",
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.dtype, torch.float32)
    with torch.device("meta"):
        model = LlamaModel(shape).to(dtype)  # type: ignore[arg-type]
    return model.train()


def peer_step(
    name: str, stack: torch.nn.Module, x: torch.Tensor, profile: Any, record: bool = False
) -> TimedReport:
    """One forward and backward of ``stack`` the way peer ``name`` runs it, unmodified,
    on the modeled ``profile`` with the modeled ``torch.cuda``."""
    importlib.import_module(PEERS[name].module)  # outside the model: imports compute
    for tensor in [x, *stack.parameters()]:
        tensor.grad = None
    with timed_runtime(profile, record=record) as run, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peers' own warnings (host memory checks, ...)
        with modeled_cuda(cast(TimedRuntime, run.live)):
            h = x.clone()  # the stack's input, as an embedding makes it: counted
            out = PEERS[name].forward(stack, h)  # held through backward, as ours is
            out.float().square().mean().backward()
    return run


@dataclass
class PeerRow:
    """A peer's modeled run, and ours at that peer's peak (None where it was skipped)."""

    mode: str
    code: str
    peer: TimedReport | None
    ours: TimedReport | None = None
    ours_policy: list[str] | None = None
    skip_reason: str | None = None
    ours_reload_slice_bytes: int | None = None
    ours_reload_on_demand_layers: tuple[int, ...] = ()

    @property
    def ours_label(self) -> str:
        if self.ours_policy is None:
            return "-"
        label = ", ".join(
            f"{last - first + 1} {''.join(w[0].upper() for w in choice.split('+'))}"
            for first, last, choice in policy_runs(self.ours_policy)
        )
        slices = self.ours_reload_slice_bytes
        if slices is None:
            return label
        on_demand = "".join(f", layer {j} on demand" for j in self.ours_reload_on_demand_layers)
        return f"{label}, O in {slices / 2**20:g} MiB slices{on_demand}"

    def as_json(self) -> dict[str, Any]:
        """The row of the JSON's ``"peers"`` list."""
        row: dict[str, Any] = {"mode": self.mode, "code": self.code}
        if self.peer is None:
            return {**row, "skip_reason": self.skip_reason}
        peer, ours = self.peer, self.ours
        row.update(
            modeled_step_s=peer.step_s,
            modeled_peak_bytes=peer.peak_bytes,
            modeled_exposed_copy_s=peer.exposed_copy_s,
            moved_bytes=peer.d2h_bytes + peer.h2d_bytes,
            modeled_d2h_bytes=peer.d2h_bytes,
            modeled_h2d_bytes=peer.h2d_bytes,
            modeled_host_peak_bytes=peer.host_peak_bytes,
            modeled_host_syncs=peer.host_syncs,
            ours_policy=self.ours_policy,
            ours_reload_slice_bytes=self.ours_reload_slice_bytes,
            ours_reload_on_demand_layers=list(self.ours_reload_on_demand_layers),
            ours_label=self.ours_label,
            ours_step_s=None if ours is None else ours.step_s,
            ours_peak_bytes=None if ours is None else ours.peak_bytes,
            ours_exposed_copy_s=None if ours is None else ours.exposed_copy_s,
            ours_moved_bytes=None if ours is None else ours.d2h_bytes + ours.h2d_bytes,
            ours_host_peak_bytes=None if ours is None else ours.host_peak_bytes,
            ours_speedup=None if ours is None else peer.step_s / ours.step_s,
            ours_fits=None if ours is None else ours.peak_bytes <= peer.peak_bytes,
        )
        return row


def hf_ours_step(
    model: torch.nn.Module,
    x: torch.Tensor,
    profile: Any,
    policy: list[str],
    min_offload_numel: int,
    record: bool = False,
    reload_slice_bytes: int | None = None,
    reload_on_demand_layers: tuple[int, ...] = (),
) -> TimedReport:
    """Ours on transformers' own Llama stack (its ``layers``, under ``offload_layers``
    with ``policy``, reloaded in slices of ``reload_slice_bytes``, on demand in
    ``reload_on_demand_layers``), unmodified, on the modeled ``torch.cuda``: the
    ``hf_offload`` row's ours."""
    for tensor in [x, *model.parameters()]:
        tensor.grad = None
    with timed_runtime(profile, record=record) as run, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k = L - 1 and checkpoint notices
        with modeled_cuda(cast(TimedRuntime, run.live)):
            handle = offload_layers(
                model.layers,  # type: ignore[arg-type]
                policy=policy,
                min_offload_numel=min_offload_numel,
                reload_slice_bytes=reload_slice_bytes,
                reload_on_demand_layers=reload_on_demand_layers,
            )
            try:
                h = x.clone()
                out = model(inputs_embeds=h, use_cache=False).last_hidden_state
                out.float().square().mean().backward()
            finally:
                handle.remove()
    return run


def ours_step(
    layers: torch.nn.ModuleList,
    x: torch.Tensor,
    profile: Any,
    min_offload_numel: int,
    record: bool,
    policy: list[str],
    reload_slice_bytes: int | None = None,
    reload_on_demand_layers: tuple[int, ...] = (),
) -> TimedReport:
    """Ours on the benchmark's stack with ``policy`` (``simulate.modeled_step``)."""
    return modeled_step(
        layers,
        x,
        profile,
        policy=policy,
        min_offload_numel=min_offload_numel,
        record=record,
        reload_slice_bytes=reload_slice_bytes,
        reload_on_demand_layers=reload_on_demand_layers,
    )


Ours = tuple[list[str], TimedReport, int | None, tuple[int, ...]]


def ours_at(
    peak: int,
    step: Callable[..., TimedReport],
    layer: LayerProfile,
    num_layers: int,
    device: Any,
    offset: int,
    gradient_bytes: int = 0,
) -> Ours:
    """Our policy for a device peak of ``peak`` bytes (NOTE [Peers on the modeled
    accelerator]), its modeled run by ``step``, the slices its offloaded layers are
    reloaded in (None: whole) and the layers whose slices come back on demand."""
    budget = max(peak - offset, 0)
    tried: list[Ours] = []
    for attempt in range(TRIES):
        chosen = choose_policy(
            layer,
            num_layers,
            device,
            memory_budget=budget,
            reload_slice_bytes=SLICE_BYTES,
            gradient_bytes=gradient_bytes,
        )
        on_demand = chosen.reload_on_demand_layers
        run = step(
            chosen.policy,
            reload_slice_bytes=chosen.reload_slice_bytes,
            reload_on_demand_layers=on_demand,
        )
        tried.append((chosen.policy, run, chosen.reload_slice_bytes, on_demand))
        over = run.peak_bytes - peak
        if over <= 0 or budget == 0:
            break
        # the planner counts saved activations of its layer; tighten by what ours
        # overshot, and at the last try ask for its least memory
        budget = 0 if attempt == TRIES - 2 else max(budget - over, 0)
    fitting = [entry for entry in tried if entry[1].peak_bytes <= peak]
    if fitting:
        return min(fitting, key=lambda tried_run: tried_run[1].step_s)
    return min(tried, key=lambda tried_run: (tried_run[1].peak_bytes, tried_run[1].step_s))


def run_peers(
    config: BenchConfig,
    profile_name: str,
    modes: list[str],
    progress: Any = None,
    record: bool = False,
) -> list[PeerRow]:
    """Every peer of ``modes`` on the modeled ``profile_name``, ours beside each;
    ``record``: keep the timelines (for ``--trace`` and plots)."""
    layers, x, layer = stack_of(config)
    plan = plan_offload(layer, config.layers, profile_name)
    device, numel = plan.device, config.min_offload_numel
    kept = modeled_step(layers, x, device, k=0, min_offload_numel=numel, record=False)
    offset = kept.peak_bytes - plan.rows[0].peak_bytes
    # the peaks are in backward, as the gradients come: the planner counts them there
    gradients = sum(p.nbytes for p in layers[0].parameters() if p.requires_grad)
    rows = []
    for mode in modes:
        peer = PEERS[mode]
        try:
            importlib.import_module(peer.module)
        except ImportError as error:
            reason = f"{peer.module} is not importable ({error}); pip install 'cpu-offload[peers]'"
            rows.append(PeerRow(mode, peer.code, None, skip_reason=reason))
            continue
        step: Callable[[list[str]], TimedReport]
        if mode == "hf_offload":
            modeled = peer_step(mode, hf_stack(config), x, device, record)
            model = hf_stack(config)  # without transformers' checkpointing
            step = functools.partial(
                hf_ours_step, model, x, device, min_offload_numel=numel, record=record
            )
        else:
            modeled = peer_step(mode, layers, x, device, record)
            step = functools.partial(ours_step, layers, x, device, numel, record)
        policy, ours, slices, on_demand = ours_at(
            modeled.peak_bytes, step, layer, config.layers, device, offset, gradients
        )
        rows.append(PeerRow(mode, peer.code, modeled, ours, policy, None, slices, on_demand))
        if progress is not None:
            progress(rows[-1])
    return rows
