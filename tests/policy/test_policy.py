"""What offload_layers(model, policy=...) wraps: how it is applied, removed and copied,
the mistakes it refuses, and the layers whose recompute would change training."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.plan import choose_policy, measure_layer
from cpu_offload.plan.__main__ import policy_json, print_policy
from cpu_offload.plan.planner import plan_offload
from cpu_offload.policy.checkpointing import CheckpointedForward
from cpu_offload.policy.policy import checkpoint_hazards


def blocks(n: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n))


def saved_by(module: nn.Module) -> int:
    """How many tensors ``module``'s forward saves for backward (outside any offload)."""
    seen: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return tensor.detach()  # not the output itself: no cycle through its grad_fn

    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return len(seen)


def ours(module: nn.Module) -> list[str]:
    """The instance attributes a policy sets on a module, where it has any."""
    return [name for name in ("forward", "__getstate__") if name in module.__dict__]


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# ------------------------------------------------------------------ removal and copies

PLAIN_SAVES = 3  # addmm's input and weight, tanh's output
CHECKPOINTED_SAVES = 1  # the checkpoint's input (a layer the hooks do not offload)


def test_a_second_policy_handle_waits_for_the_first_to_be_removed():
    model = blocks()
    first = offload_layers(model, policy=["checkpoint", "keep", "keep"], min_offload_numel=0)
    assert isinstance(model[0].__dict__["forward"], CheckpointedForward)
    with pytest.raises(RuntimeError, match=r"layer 0 \(Sequential\) is already hooked by an"):
        offload_layers(model, policy=["checkpoint", "keep", "keep"], min_offload_numel=0)
    assert saved_by(model[0]) == CHECKPOINTED_SAVES  # the first handle still checkpoints
    first.remove()
    assert ours(model[0]) == [] and saved_by(model[0]) == PLAIN_SAVES
    second = offload_layers(model, policy=["checkpoint", "keep", "keep"], min_offload_numel=0)
    second.enabled = False
    assert saved_by(model[0]) == PLAIN_SAVES
    second.enabled = True
    assert saved_by(model[0]) == CHECKPOINTED_SAVES
    second.remove()
    assert ours(model[0]) == [] and saved_by(model[0]) == PLAIN_SAVES


def copy_of(model: nn.Module, how: str) -> nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


def test_a_copy_of_a_policy_model_carries_nothing_and_is_freed_by_reference_counting():
    model = blocks()
    handle = offload_layers(
        model, policy=["checkpoint+offload", "offload", "checkpoint"], min_offload_numel=0
    )
    with gc_off():
        for how in ("deepcopy", "torch.load"):
            twin = copy_of(model, how)
            assert [ours(layer) for layer in twin] == [[], [], []], how
            assert saved_by(twin[0]) == PLAIN_SAVES, how  # runs as the plain model
            # offload_layers on the copy, then remove(): the copy is as it was
            offload_layers(twin, policy=["checkpoint", "keep", "keep"]).remove()
            assert ours(twin[0]) == [], how
            weights = weakref.ref(twin[0][0].weight)
            del twin
            assert weights() is None, f"a {how} copy outlived its last reference"
        assert ours(model[0]) == ["forward", "__getstate__"]  # the original keeps its own
    handle.remove()
    with gc_off():
        weights = weakref.ref(model[0][0].weight)
        del model, handle
        assert weights() is None


def test_a_wrapper_set_over_ours_keeps_working_after_remove():
    model = blocks()
    handle = offload_layers(model, policy=["checkpoint", "keep", "keep"], min_offload_numel=0)
    inner = model[0].forward
    model[0].forward = lambda x: inner(x).exp()  # someone else's wrapper, over ours
    assert saved_by(model[0]) == CHECKPOINTED_SAVES + 1  # ours inside it; exp saves its output
    handle.remove()  # ours cannot be unlinked: it passes through
    assert saved_by(model[0]) == PLAIN_SAVES + 1
    assert ours(model[0]) == ["forward"]  # the other wrapper only


class Doubled:
    """Someone else's forward wrapper, as an instance attribute."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


@pytest.mark.parametrize("how", ["deepcopy", "torch.load"])
def test_wrappers_of_others_around_ours_are_copied_without_ours(how):
    model = blocks()
    model[1].forward = Doubled(model[1].forward)  # before ours: ours shadows it
    handle = offload_layers(model, policy=["checkpoint", "checkpoint", "keep"])
    model[0].forward = Doubled(model[0].forward)  # after ours: it holds ours
    twin = copy_of(model, how)
    x = torch.randn(2, 8)
    for index in (0, 1):
        forward = twin[index].__dict__["forward"]
        assert isinstance(forward, Doubled) and not isinstance(forward.inner, CheckpointedForward)
        assert forward.inner.__self__ is twin[index]  # the copy's own class forward
        assert torch.equal(twin[index](x), model[index](x))
    assert "__getstate__" not in twin[1].__dict__
    handle.remove()
    assert isinstance(model[1].__dict__["forward"], Doubled)  # given back
    assert ours(model[1]) == ["forward"]


# ------------------------------------------------------------------ what the layer gets


class Recorder(nn.Module):
    """Records the cache arguments of each call (forward, then the recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls: list[tuple[object, object, dict[str, object]]] = []

    def forward(self, x, past_key_values=None, use_cache=False, **kwargs):
        self.calls.append((past_key_values, use_cache, kwargs))
        return self.linear(x).tanh()


class Reader(Recorder):
    _can_checkpoint_with_cache = True  # transformers' flag: it only reads the cache


@pytest.mark.parametrize("layer_type", [Recorder, Reader])
def test_a_checkpointed_layer_runs_without_its_cache(layer_type):
    cache = object()
    layer = layer_type()
    handle = offload_layers([layer, nn.Linear(8, 8)], policy=["checkpoint", "keep"])
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning) as caught:
        layer(x, cache, use_cache=True, layer_past=cache, other=1).sum().backward()
        layer(x, cache, use_cache=True, layer_past=cache, other=1).sum().backward()
    kept = cache if layer_type is Reader else None
    assert layer.calls == [(kept, False, {"layer_past": kept, "other": 1})] * 4
    assert len(caught) == 1  # once per handle
    dropped = "use_cache=True" + (
        "" if layer_type is Reader else ", a cache in past_key_values and a cache in layer_past"
    )
    assert f"checkpoints layer 0 ({layer_type.__name__}), which was called with {dropped}. " in (
        str(caught[0].message)
    )
    layer.calls.clear()
    with torch.no_grad():  # nothing is checkpointed: the cache is used
        layer(x, cache, use_cache=True, layer_past=cache)
    handle.enabled = False
    layer(x, past_key_values=cache, use_cache=True)
    assert layer.calls == [(cache, True, {"layer_past": cache}), (cache, True, {})]
    handle.remove()


# ------------------------------------------------------------------ mistakes refused


@pytest.mark.parametrize(
    "call",
    [lambda m: offload_layers(m, policy=[]), lambda m: offload_layers(m, 0)],
    ids=["policy", "k"],
)
def test_an_empty_list_of_layers_is_refused(call):
    with pytest.raises(ValueError) as raised:
        call(nn.ModuleList())
    assert str(raised.value) == (
        "offload_layers: ModuleList holds no layers, so there is nothing to offload; pass "
        "the model's decoder layers (a non-empty list or ModuleList)."
    )


@pytest.mark.parametrize(
    ("chooser", "named"),
    [
        ({"policy": ["offload", "keep", "keep"]}, "policy=[...]"),
        ({"num_offloaded_layers": 1}, "k=1"),
    ],
    ids=["policy", "k"],
)
def test_offloaded_layers_beside_a_policy_or_k_is_refused(chooser, named):
    model = blocks()
    with pytest.raises(TypeError) as raised:
        offload_layers(model, offloaded_layers=[1], **chooser)
    assert f"offloaded_layers= and {named} both choose the layers to offload" in str(raised.value)
    assert ours(model[0]) == [] and not model[0]._forward_pre_hooks


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: offload_layers(blocks(), 1, min_offload_numel=True),
            ValueError,
            "cpu_offload: min_offload_numel must be an int >= 0, got True.",
        ),
        (
            lambda: get_cpu_offload_context(True, True, 4),
            ValueError,
            "got num_layers=True, model_layers=4",
        ),
        (
            lambda: get_cpu_offload_context(True, 0, True),
            ValueError,
            "cpu_offload: model_layers must be an int >= 1, got True.",
        ),
    ],
    ids=["min_offload_numel", "num_layers", "model_layers"],
)
def test_a_bool_is_not_a_count(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value)


def test_the_planner_takes_no_bool_for_a_number_of_layers():
    layer = measure_layer(lambda: nn.Linear(64, 64), torch.empty(8, 64, device="meta"))
    with pytest.raises(TypeError, match="num_layers must be an int, got True"):
        choose_policy(layer, True, memory_budget=2**20)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_layers must be an int, got True"):
        plan_offload(layer, True)  # type: ignore[arg-type]


# ------------------------------------------------------------------ recompute hazards


class Noisy(nn.Module):
    """Adds noise from a generator of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.generator)
        return self.linear(x) * noise  # mul saves the noise for backward


def normed() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))


def test_checkpoint_hazards_names_running_statistics_and_own_generators():
    assert checkpoint_hazards(normed()) == [
        "1 (BatchNorm1d) updates its running statistics in training mode, and again in the "
        "recompute (eval() or track_running_stats=False avoid it)"
    ]
    assert checkpoint_hazards(Noisy()) == [
        "the layer (Noisy) draws from its own torch.Generator (generator), which "
        "checkpointing does not restore: the recompute draws other numbers (draw from the "
        "default generator, which it restores)"
    ]
    assert checkpoint_hazards(nn.InstanceNorm1d(8)) == []  # no running statistics
    assert checkpoint_hazards(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))) == []


def test_the_hazards_are_real():
    """What the warning says happens: running statistics updated twice, other noise."""
    layer = normed()
    with pytest.warns(UserWarning, match="changes training"):
        handle = offload_layers([layer, nn.Linear(8, 8)], policy=["checkpoint", "keep"])
    layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    handle.remove()
    assert layer[1].num_batches_tracked.item() == 2  # one forward, counted twice
    torch.manual_seed(0)
    plain = Noisy()
    torch.manual_seed(0)
    noisy = Noisy()
    x = torch.randn(4, 8, requires_grad=True)
    plain(x).pow(2).sum().backward()
    with pytest.warns(UserWarning, match="changes training"):
        handle = offload_layers([noisy, nn.Linear(8, 8)], policy=["checkpoint", "keep"])
    noisy(x).pow(2).sum().backward()
    handle.remove()
    assert not torch.equal(plain.linear.weight.grad, noisy.linear.weight.grad)


def test_offload_layers_warns_once_when_it_checkpoints_such_layers():
    model = [nn.Linear(8, 8), normed(), Noisy(), normed()]
    with pytest.warns(UserWarning) as caught:
        handle = offload_layers(
            model, policy=["checkpoint", "checkpoint+offload", "checkpoint", "keep"]
        )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(
        "cpu_offload: offload_layers checkpoints layers whose forward, run again in backward, "
        "changes training: layer 1 (Sequential): 1 (BatchNorm1d) updates its running "
        "statistics in training mode, and again in the recompute (eval() or "
        "track_running_stats=False avoid it); layer 2 (Noisy): the layer (Noisy) draws "
        "from its own torch.Generator (generator)"
    )
    assert "layer 3" not in message  # kept: not checkpointed
    assert message.endswith(
        "Give these layers 'keep' or 'offload' instead (the planner does not checkpoint "
        "them), or remove the cause."
    )
    handle.remove()


def test_the_planner_does_not_checkpoint_such_layers():
    def make() -> nn.Module:
        return nn.Sequential(
            nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.BatchNorm1d(512)
        )

    layer = measure_layer(make, torch.empty(4096, 512, device="meta"))
    assert layer.checkpoint_hazards == checkpoint_hazards(make())
    for budget in (layer.saved_bytes * 6, layer.saved_bytes * 2, 0):
        choice = choose_policy(layer, 8, memory_budget=budget)
        assert not any("checkpoint" in c for c in choice.policy), choice.policy
        assert choice.checkpoint_refused == layer.checkpoint_hazards
    plain = measure_layer(lambda: make()[:3], torch.empty(4096, 512, device="meta"))
    assert "checkpoint" in " ".join(choose_policy(plain, 8, memory_budget=0).policy)


def test_the_plan_says_why_it_did_not_checkpoint(capsys):
    layer = measure_layer(
        lambda: nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512)),
        torch.empty(4096, 512, device="meta"),
    )
    choice = choose_policy(layer, 4, memory_budget=0)
    print_policy(choice)
    out = capsys.readouterr().out
    assert "NOTHING FITS without checkpointing (refused below); the closest of" in out
    assert (
        "  checkpointing refused: recomputing the layer changes training: 1 (BatchNorm1d) "
        "updates its running statistics in training mode, and again in the recompute"
    ) in out
    assert policy_json(choice)["policy_checkpoint_refused"] == layer.checkpoint_hazards
