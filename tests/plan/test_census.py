"""measure_layer against real runs (bytes for bytes) and against Korthikanti et al. 2022."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import small_llama_config, tiny_preset_run
from hosts import require

from cpu_offload import offload_layers
from cpu_offload.device.profiles import get_profile
from cpu_offload.plan import measure_layer, plan_offload, simulate_policy
from cpu_offload.plan.layers import GptLayer, gpt_layer, hf_layer, preset_layer
from cpu_offload.plan.schedule_model import LayerCosts

THRESHOLDS = [0, 2**15, 2**18]


def real_stats(model, k, min_numel, step):
    handle = offload_layers(model, k, min_offload_numel=min_numel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k = L - 1 warns that copies cannot overlap
        step()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    return stats.bytes_offloaded, stats.tensors_offloaded


@pytest.mark.parametrize("min_numel", THRESHOLDS)
def test_tiny_preset_plans_the_bytes_a_real_run_moves_for_every_k(min_numel):
    layer, model, tokens = tiny_preset_run(min_numel)
    for k in range(1, 4):
        moved = real_stats(model, k, min_numel, lambda: model.loss(tokens).backward())
        assert moved == (k * layer.offloaded_bytes, k * layer.tensors_offloaded), k
    assert layer.saved_bytes >= layer.offloaded_bytes > 0
    assert (layer.kept_bytes > 0) == (min_numel > 0)  # small tensors stay above 0


@pytest.mark.parametrize("min_numel", [0, 2**16])
def test_hugging_face_config_plans_the_bytes_a_real_run_moves(tmp_path, min_numel):
    transformers = require("transformers")
    config = small_llama_config(transformers, tmp_path)
    spec = hf_layer(str(tmp_path / "config.json"), 256, 2, torch.float32, "cpu")
    assert spec.num_layers == 4 and "LlamaDecoderLayer" in spec.description
    layer = measure_layer(
        spec.make_layer,
        spec.inputs,
        kwargs=spec.kwargs,
        min_offload_numel=min_numel,
        attention="cpu",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 256))
    for k in range(1, 4):
        moved = real_stats(
            model, k, min_numel, lambda: model(input_ids=ids, labels=ids).loss.backward()
        )
        assert moved == (k * layer.offloaded_bytes, k * layer.tensors_offloaded), k


def korthikanti(s, b, h, a, attention_term=True):
    """Bytes per layer, Korthikanti et al. 2022, section 4.1."""
    return s * b * h * (34 + (5 * a * s / h if attention_term else 0))


SHAPES = [(2048, 4, 1024, 16), (4096, 1, 4096, 32), (1024, 8, 2048, 16)]


@pytest.mark.parametrize("s, b, h, a", SHAPES)
def test_gpt_layer_saves_what_korthikanti_et_al_count(s, b, h, a):
    spec = gpt_layer(s, b, h, a, torch.bfloat16, "math")
    layer = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=0, attention="math")
    assert layer.saved_bytes == pytest.approx(korthikanti(s, b, h, a), rel=0.02)


@pytest.mark.parametrize("s, b, h, a", SHAPES)
def test_flash_attention_removes_the_quadratic_term(s, b, h, a):
    """Without the s x s probabilities, what is left is the paper's 34 s b h plus the
    attention output the flash backward keeps besides the projection's input (2 s b h)."""
    spec = gpt_layer(s, b, h, a, torch.bfloat16, "flash")
    layer = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=0, attention="flash")
    assert layer.saved_bytes == pytest.approx(s * b * h * 36, rel=0.02)
    longer = gpt_layer(2 * s, b, h, a, torch.bfloat16, "flash")
    doubled = measure_layer(longer.make_layer, longer.inputs, min_offload_numel=0)
    assert doubled.saved_bytes == pytest.approx(2 * layer.saved_bytes, rel=0.01)  # linear in s


def test_flops_of_a_linear_layer():
    make = lambda: torch.nn.Linear(512, 1024)  # noqa: E731
    layer = measure_layer(make, torch.empty(64, 512, device="meta"), min_offload_numel=0)
    assert layer.forward_flops == 2 * 64 * 512 * 1024
    assert layer.backward_flops == 2 * layer.forward_flops  # input and weight gradients
    assert layer.saved_bytes == 64 * 512 * 4  # the input; the weight is a parameter


def test_the_kernels_of_a_layer_carry_its_flops_and_the_bytes_it_moves():
    """forward and backward kernels: the matmuls and the elementwise work beside them,
    which a device profile with a memory bandwidth times as a roofline."""
    make = lambda: torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU())  # noqa: E731
    layer = measure_layer(make, torch.empty(8192, 4096, device="meta"), min_offload_numel=0)
    assert sum(f for f, _ in layer.forward_kernels) == layer.forward_flops
    assert sum(f for f, _ in layer.backward_kernels) == layer.backward_flops
    gelu = 2 * 8192 * 4096 * 4  # reads its input, writes its output (float32)
    assert (0, gelu) in layer.forward_kernels
    h100 = get_profile("h100")
    roofline = sum(h100.kernel_seconds(f, b) for f, b in layer.forward_kernels)
    assert LayerCosts.of(layer, h100).forward_s == pytest.approx(roofline)
    assert roofline > layer.forward_flops / h100.flops_per_s  # GELU is memory-bound
    small = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())  # noqa: E731
    tiny = measure_layer(small, torch.empty(4, 64, device="meta"), min_offload_numel=0)
    issue = len(tiny.forward_kernels) * h100.host_issue_s  # launch-bound: the host's pace
    assert LayerCosts.of(tiny, h100).forward_s == pytest.approx(issue)


def test_a_recompute_stops_at_the_last_saved_tensor():
    """Non-reentrant checkpointing recomputes up to the layer's last saved tensor: a layer
    ending in a matmul saves that matmul's input before it runs, so its recompute does
    not run it (the planner used to charge a whole forward)."""
    make = lambda: torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    )  # noqa: E731
    layer = measure_layer(make, torch.empty(64, 512, device="meta"), min_offload_numel=0)
    assert layer.forward_kernels[-1][0] == 2 * 64 * 1024 * 512  # the last Linear's
    assert layer.recompute_kernels == layer.forward_kernels[:-1]
    costs = LayerCosts.of(layer, get_profile("h100"))
    assert costs.recompute < costs.forward_s
    x = torch.randn(64, 512, requires_grad=True)
    model = make()
    counted = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted.append(func)
            return func(*args, **(kwargs or {}))

    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    with Count():
        y.sum().backward()
    assert counted.count(torch.ops.aten.addmm.default) == 1  # recomputed: the first only


def test_classification_names_why_tensors_stay():
    spec = preset_layer("tiny")
    layer = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=2**18, attention="cpu")
    assert set(layer.kept_by_reason) == {"small"}
    reasons = {reason for _, _, reason in layer.saved}
    assert reasons == {"offloaded", "small", "parameter"}


def test_inputs_must_be_meta_tensors():
    with pytest.raises(ValueError, match="example input 0 is on cpu; pass meta tensors"):
        measure_layer(lambda: torch.nn.Linear(4, 4), torch.randn(2, 4))


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match=r"attention must be one of \('flash', 'cpu', 'math'\)"):
        measure_layer(
            lambda: torch.nn.Linear(4, 4), torch.empty(2, 4, device="meta"), attention="x"
        )


@pytest.mark.parametrize("min_numel", [0, 2**12])
def test_gpt2_at_its_default_use_cache_plans_the_bytes_a_real_run_moves(tmp_path, min_numel):
    """GPT-2 ships use_cache=True: its layer appends to the cache, and what attention
    saves is the cache's keys and values. The planner measures the layer that way, for
    offloaded layers and for checkpointed ones (which run without the cache)."""
    transformers = require("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=128, attn_pdrop=0.0
    )  # no attention dropout: on the CPU it takes sdpa's math path, not modelled here
    assert config.use_cache
    config.save_pretrained(tmp_path)
    spec = hf_layer(str(tmp_path / "config.json"), 128, 2, torch.float32, "cpu")
    layer = measure_layer(
        spec.make_layer,
        spec.inputs,
        kwargs=spec.kwargs,
        min_offload_numel=min_numel,
        attention="cpu",
        fused_dropout=False,  # the CPU's dropout saves its scaled mask
    )
    again = measure_layer(
        spec.make_layer,
        spec.inputs,
        kwargs=spec.kwargs,
        min_offload_numel=min_numel,
        attention="cpu",
        fused_dropout=False,
    )
    assert again.offloaded_bytes == layer.offloaded_bytes  # each from an empty cache
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 128))
    step = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    for k in range(1, 4):
        moved = real_stats(model, k, min_numel, step)
        assert moved == (k * layer.offloaded_bytes, k * layer.tensors_offloaded), k
    policy = ["offload", "checkpoint+offload", "checkpoint", "keep"]
    handle = offload_layers(model, policy=policy, min_offload_numel=min_numel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the checkpointed layers run without the cache
        step()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    expected = layer.offloaded_bytes + layer.input_offloaded_bytes
    assert (stats.bytes_offloaded, stats.tensors_offloaded) == (
        expected,
        layer.tensors_offloaded + layer.input_tensors_offloaded,
    )


class SlicedOutput(torch.nn.Module):
    """A layer whose output is a strided view of a larger tensor: 8 of its 9 columns."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))[..., :8]


def policy_stats(model, policy, step):
    handle = offload_layers(model, policy=policy, min_offload_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # L - 1 offloaded layers warn that copies cannot overlap
        step()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    return stats.bytes_offloaded, stats.tensors_offloaded


POLICIES = [
    ["offload", "offload", "offload", "keep"],
    ["checkpoint+offload"] * 3 + ["keep"],
    ["keep", "checkpoint+offload", "offload", "checkpoint"],
    ["checkpoint+offload", "keep", "keep", "keep"],
]


@pytest.mark.parametrize("policy", POLICIES, ids=["-".join(p) for p in POLICIES])
def test_a_layer_whose_output_is_a_view_plans_the_bytes_a_real_run_moves(policy):
    """The layers after the first receive a view of a larger tensor: what they save of it
    (their checkpointed input, the linear's input) moves through its base."""
    layer = measure_layer(SlicedOutput, torch.empty(16, 16, 8, device="meta"), min_offload_numel=0)
    predicted = simulate_policy(policy, LayerCosts.of(layer, get_profile("h100")), 1e9, 1e9)
    torch.manual_seed(0)
    model = torch.nn.ModuleList(SlicedOutput() for _ in range(4))
    x = torch.randn(16, 16, 8, requires_grad=True)

    def step():
        h = x
        for block in model:
            h = block(h)
        h.sum().backward()

    moved, copies = policy_stats(model, policy, step)
    assert moved == predicted.offloaded_bytes
    if "checkpoint" not in " ".join(policy):
        k = policy.count("offload")
        assert moved == plan_offload(layer, 4).rows[k].offloaded_bytes
    assert layer.input_offloaded_bytes == 16 * 16 * 8 * 4  # the first layer's own input
    assert layer.following.input_offloaded_bytes == 16 * 16 * 9 * 4  # the base, not the view
    assert layer.unpredictable == ""


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_attention_dropout_on_the_cpu_plans_the_bytes_a_real_run_moves(dropout):
    """The CPU's flash kernel takes no dropout: sdpa runs its math implementation there."""
    s, b, h, a = 64, 2, 64, 4
    make = lambda: GptLayer(h, a, dropout=dropout, sdpa=True)  # noqa: E731
    x = torch.empty(s, b, h, device="meta")
    layer = measure_layer(make, x, min_offload_numel=0, attention="cpu", fused_dropout=False)
    probabilities = [r for r in layer.saved if r[0] == (b, a, s, s)]
    assert bool(probabilities) == (dropout > 0)  # the math path saves them
    torch.manual_seed(0)
    model = torch.nn.ModuleList(make() for _ in range(3))
    x = torch.randn(s, b, h, requires_grad=True)

    def step():
        out = x
        for block in model:
            out = block(out)
        out.sum().backward()

    for k in (1, 2):
        moved = real_stats(model, k, 0, step)
        assert moved == (k * layer.offloaded_bytes, k * layer.tensors_offloaded), k


class Alternating(torch.nn.Module):
    """A layer whose output is a view of a 9- or 10-column tensor, whichever its input
    is not: every layer of a stack of it receives another input than the one before."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = 10 if x.stride(-2) == 9 else 9
        return torch.tanh(self.linear(x))[..., :wide].contiguous()[..., :8]


def test_a_plan_says_which_layers_it_cannot_predict():
    layer = measure_layer(Alternating, torch.empty(16, 16, 8, device="meta"), min_offload_numel=0)
    assert layer.following is not None
    assert layer.following.input_offloaded_bytes == 16 * 16 * 9 * 4
    assert layer.unpredictable.startswith("layers 2 to L-1: the layer's output is laid out")
    assert "(20480 B offloaded against 19456 B)" in layer.unpredictable


def test_a_layer_whose_output_is_its_own_tensor_is_measured_once():
    spec = preset_layer("tiny")
    layer = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=0, attention="cpu")
    assert layer.following is None and layer.unpredictable == ""


def test_the_table_and_the_json_show_the_layers_after_the_first(capsys):
    from cpu_offload.plan.__main__ import print_plan, to_json

    layer = measure_layer(Alternating, torch.empty(16, 16, 8, device="meta"), min_offload_numel=0)
    plan = plan_offload(layer, 4)
    print_plan(plan, "alternating")
    out = capsys.readouterr().out
    assert "layers 1 to L-1 (their input is the previous layer's output" in out
    assert "NOT PREDICTED: layers 2 to L-1" in out
    document = to_json(plan, "alternating")["layer"]
    assert document["following"]["input_offloaded_bytes"] == 16 * 16 * 9 * 4
    assert "saved" not in document["following"] and document["unpredictable"]


MODULE_CHOICES = [
    {"core_attn": "keep"},
    ["qkv_linear", "core_attn", "attn_proj"],
    {"self_attn.q_proj": "keep", "mlp": "keep", "mlp.down_proj": "offload"},
    {"attn_norm": "keep", "mlp_norm": "keep", "rest": "offload"},
]


@pytest.mark.parametrize("modules", MODULE_CHOICES, ids=str)
def test_module_choices_plan_the_bytes_a_real_run_moves(tmp_path, modules):
    """offload_layers(modules=...) moves, byte for byte and copy for copy, what
    measure_layer(modules=...) predicts; what the choices keep is counted as kept."""
    transformers = require("transformers")
    config = small_llama_config(transformers, tmp_path)
    spec = hf_layer(str(tmp_path / "config.json"), 64, 2, torch.float32, "cpu")
    whole = measure_layer(
        spec.make_layer, spec.inputs, kwargs=spec.kwargs, min_offload_numel=0, attention="cpu"
    )
    layer = measure_layer(
        spec.make_layer,
        spec.inputs,
        kwargs=spec.kwargs,
        min_offload_numel=0,
        attention="cpu",
        modules=modules,
    )
    assert 0 < layer.offloaded_bytes < whole.offloaded_bytes
    assert layer.saved_bytes == whole.saved_bytes
    assert layer.kept_by_reason["modules= keep"] > 0
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 64))
    handle = offload_layers(model, 2, min_offload_numel=0, modules=modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, labels=ids).loss.backward()
    stats = handle.offload_synchronizer.stats
    handle.remove()
    assert (stats.bytes_offloaded, stats.tensors_offloaded) == (
        2 * layer.offloaded_bytes,
        2 * layer.tensors_offloaded,
    )


def test_saved_bytes_per_submodule_and_kind_add_up():
    spec = preset_layer("tiny")
    layer = measure_layer(spec.make_layer, spec.inputs, min_offload_numel=0, attention="cpu")
    assert sum(layer.saved_by_module.values()) == layer.saved_bytes
    assert sum(layer.saved_by_kind.values()) == layer.saved_bytes
    assert {"attn_norm", "mlp_norm", "down"} <= set(layer.saved_by_module)
    assert {"matmul", "norm", "elementwise", "attention"} <= set(layer.saved_by_kind)
    kept = measure_layer(
        spec.make_layer,
        spec.inputs,
        min_offload_numel=0,
        attention="cpu",
        modules={"attn_norm": "keep", "mlp_norm": "keep"},
    )
    norms = layer.saved_by_module["attn_norm"] + layer.saved_by_module["mlp_norm"]
    assert kept.kept_by_reason["modules= keep"] == norms
    assert kept.offloaded_bytes == layer.offloaded_bytes - norms
