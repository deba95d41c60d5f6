"""Property-based: random layers, saved tensors and manual schedules under strict_streams."""

from __future__ import annotations

import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_offload import LayerState, OffloadStateError, get_cpu_offload_context, start_offload
from cpu_offload.testing import strict_streams

KINDS = [
    "same",
    "restride",
    "narrow",
    "qkv_marked",
    "flat",
    "fp16",
    "bf16",
    "int64",
    "bool",
    "small",
    "permuted",
]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class SaveAndUse(torch.autograd.Function):
    """Saves arbitrary tensors; the gradient depends on every value saved."""

    @staticmethod
    def forward(ctx, x, log, *saved):
        ctx.log = log
        ctx.save_for_backward(*saved)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        total = torch.zeros((), dtype=torch.float64)
        for tensor in ctx.saved_tensors:
            ctx.log.append((tuple(tensor.shape), tensor.stride(), tensor.dtype))
            total = total + tensor.double().sum()
        return (grad * total.float().tanh(), None) + (None,) * len(ctx.saved_tensors)


def saved_tensors(a: torch.Tensor, kinds: list[str]) -> list[torch.Tensor]:
    rows, cols = a.shape
    made = []
    for kind in kinds:
        if kind == "same":
            made.append(a)  # saving it twice is a duplicate
        elif kind == "restride":
            made.append(a.t())
        elif kind == "narrow":
            made.append(a[:, : cols // 2])  # stays on the device
        elif kind == "qkv_marked":
            q, k, v = (t.view(rows, 2, -1).transpose(0, 1) for t in a.chunk(3, dim=1))
            start_offload(q, k, v, offload_base_tensor=True)
            made.extend([q, k, v])
        elif kind == "flat":
            made.append(a.reshape(-1))
        elif kind in ("fp16", "bf16"):
            made.append(a.to(torch.float16 if kind == "fp16" else torch.bfloat16))
        elif kind == "int64":
            made.append((a * 100).long())
        elif kind == "bool":
            made.append(a > 0)
        elif kind == "small":
            made.append(a[:1, :1].clone())
        elif kind == "permuted":
            made.append(
                a.view(rows, 3, -1).permute(2, 0, 1).clone(memory_format=torch.preserve_format)
            )
    return made


def run(layer_kinds, weights, schedule=None, calls=None, offload=True):
    """Forward through the layers, apply manual calls, backward; returns grads and logs."""
    log: list = []
    ctx = sync_fn = controller = None
    if offload:
        ctx, sync_fn, controller = get_cpu_offload_context(
            True,
            model_layers=len(layer_kinds),
            manual_synchronization=True,
            min_offload_numel=8,
        )
    for w in weights:
        w.grad = None
    x = torch.linspace(-1, 1, 6 * 12).view(6, 12).requires_grad_()
    outcomes = []
    for layer, kinds in enumerate(layer_kinds):
        with ctx if ctx is not None else _null():
            a = x * weights[layer]
            x = SaveAndUse.apply(a, log, *saved_tensors(a, kinds))
        if offload:
            x = sync_fn(x)
            for action, target in (schedule or {}).get(layer, []):
                getattr(controller, action)(target)
    if offload and calls:
        outcomes = [_call(controller, action, target) for action, target in calls]
    x.sum().backward()
    return [w.grad.clone() for w in weights], log, outcomes


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def _call(controller, action, target):
    try:
        getattr(controller, action)(target)
        return "ok"
    except OffloadStateError:
        return "error"


layer_kinds_strategy = st.lists(
    st.lists(st.sampled_from(KINDS), min_size=1, max_size=5), min_size=1, max_size=4
)


@st.composite
def legal_schedules(draw):
    """Slots after layer forwards (len(kinds) - 1 is the last) for each layer's calls."""
    kinds = draw(layer_kinds_strategy)
    last = len(kinds) - 1
    schedule: dict[int, list] = {}
    for layer in range(len(kinds)):
        if not draw(st.booleans()):
            continue
        offload_at = draw(st.integers(layer, last))
        release_at = draw(st.integers(offload_at, last))
        actions = [
            (offload_at, "start_offload_layer"),
            (release_at, "release_activation_forward_gpu_memory"),
        ]
        if draw(st.booleans()):  # else: reloaded on demand by backward
            actions.append((draw(st.integers(release_at, last)), "start_reload_layer"))
        for slot, action in actions:
            schedule.setdefault(slot, []).append((action, layer))
    return kinds, schedule


def compare_to_no_offload(kinds, **offload):
    """Run without offload, then with ``offload`` under strict_streams; check grads.

    Returns both saved-tensor logs and the outcomes of the manual calls.
    """
    weights = [torch.full((1,), 0.5 + 0.1 * i).requires_grad_() for i in range(len(kinds))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, expected_log, _ = run(kinds, weights, offload=False)
        with strict_streams() as sim:
            actual, actual_log, outcomes = run(kinds, weights, **offload)
    assert all(torch.equal(a, b) for a, b in zip(expected, actual))
    assert sim.counters.hazards == 0
    return expected_log, actual_log, outcomes


@SETTINGS
@given(legal_schedules())
def test_random_legal_manual_schedules_are_bit_exact(case):
    kinds, schedule = case
    expected_log, actual_log, _ = compare_to_no_offload(kinds, schedule=schedule)
    assert actual_log == expected_log  # shapes, strides and dtypes of every saved tensor


ACTIONS = ["start_offload_layer", "release_activation_forward_gpu_memory", "start_reload_layer"]


def predicted_outcomes(num_layers, calls):
    """A model of the state machine: which calls are legal."""
    state = {layer: LayerState.NOT_OFFLOADED for layer in range(num_layers)}
    needs = dict(
        zip(
            ACTIONS,
            [LayerState.NOT_OFFLOADED, LayerState.OFFLOAD_STARTED, LayerState.OFFLOAD_FINISHED],
        )
    )
    after = dict(
        zip(
            ACTIONS,
            [LayerState.OFFLOAD_STARTED, LayerState.OFFLOAD_FINISHED, LayerState.RELOAD_STARTED],
        )
    )
    outcomes = []
    for action, layer in calls:
        if state[layer] is needs[action]:
            state[layer] = after[action]
            outcomes.append("ok")
        elif action == "start_reload_layer" and state[layer] is LayerState.RELOAD_STARTED:
            outcomes.append("ok")  # a repeated prefetch request: harmless (issue 51)
        else:
            outcomes.append("error")
    return outcomes


@SETTINGS
@given(layer_kinds_strategy, st.data())
def test_random_call_orders_raise_exactly_when_illegal(kinds, data):
    calls = data.draw(
        st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, len(kinds) - 1)), max_size=10)
    )
    _, _, outcomes = compare_to_no_offload(kinds, calls=calls)
    assert outcomes == predicted_outcomes(len(kinds), calls)
