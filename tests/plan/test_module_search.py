"""The search per submodule (plan/module_search.py): never slower than the layer-level
search, the winner where keeping a part must win, the command's flag and table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_offload.plan import DeviceProfile, choose_policy, measure_layer
from cpu_offload.plan.__main__ import main
from cpu_offload.plan.layers import preset_layer
from cpu_offload.plan.module_search import (
    ModuleSearch,
    candidate_modules,
    granularity_table,
)
from cpu_offload.plan.module_search import main as table_main


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("device", ["h100", "910b"])
def test_never_slower_than_the_layer_level_search(preset, device):
    """At every budget the answer fits where the layer-level one does and is at most as
    slow; its layer-level plan is today's choose_policy."""
    spec = preset_layer(preset)
    search = ModuleSearch(spec.make_layer, spec.inputs, 4, device, attention="cpu")
    assert search.candidates[0] == ("layer-level", None) and len(search.candidates) > 3
    whole = search.profiles[0]
    for step in range(1, 17):
        budget = whole.saved_bytes * step // 4
        found = search.choose(budget)
        today = choose_policy(whole, 4, device, memory_budget=budget)
        assert found.layer_level.policy == today.policy
        if today.fits:
            assert found.plan.fits
            assert found.plan.predicted.step_s <= today.predicted.step_s
            assert found.gain >= 0
        if found.label == "layer-level":
            assert found.modules is None and found.plan.policy == today.policy


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(1024, 1024), nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


def test_keeping_a_part_wins_where_it_must():
    """Four layers saving S each (a third in ``a``), a budget of 3.5 S, a slow link: all
    kept does not fit; offloading a whole layer exposes its copy and checkpointing one
    recomputes it; keeping ``a`` and offloading the rest of layer 0 fits (3 1/3 S) with
    a copy two thirds as long: module-level wins."""
    x = torch.empty(4096, 1024, device="meta")
    device = DeviceProfile(link_bytes_per_s=1e9, flops_per_s=1e12)
    search = ModuleSearch(
        Two, x, 4, device, candidates=[("keep a", {"a": "keep"})], min_offload_numel=0
    )
    saved = search.profiles[0].saved_bytes
    assert search.profiles[1].saved_by_module["a"] * 3 == saved
    found = search.choose(saved * 7 // 2)
    assert (found.label, found.modules) == ("keep a", {"a": "keep"})
    assert found.plan.policy[0] == "offload" and found.layer_level.policy[0] == "checkpoint"
    assert found.gain > 0.03
    kept = measure_layer(Two, x, min_offload_numel=0, modules={"a": "keep"})
    assert found.plan.policy == choose_policy(kept, 4, device, memory_budget=saved * 7 // 2).policy


def test_the_candidates_are_the_parts_the_layer_has():
    with torch.device("meta"):
        llama = preset_layer("tiny").make_layer()
        moe = preset_layer("tiny-moe").make_layer()
    labels = [label for label, _ in candidate_modules(llama)]
    assert labels == [
        "layer-level",
        "keep norms",
        "keep attn_norm",
        "keep qkv_linear",
        "keep attn_proj",
        "keep mlp_norm",
        "keep rest",
    ]
    moe_labels = [label for label, _ in candidate_modules(moe)]
    assert "keep expert_fc1" in moe_labels and "keep moe_act" in moe_labels
    assert candidate_modules(Two()) == [("layer-level", None)]


def test_the_command_chooses_per_module(tmp_path, capsys):
    path = tmp_path / "plan.json"
    main(["--preset", "tiny", "--memory-budget", "0.05", "--per-module", "--json", str(path)])
    out = capsys.readouterr().out
    assert "per module: " in out and "predicted step ms per candidate" in out
    document = json.loads(path.read_text())["per_module"]
    assert document["tried"][0]["label"] == "layer-level" and document["gain"] >= 0


@pytest.mark.parametrize(
    "argv",
    [["--per-module"], ["--per-module", "--memory-budget", "1", "--modules", "attn_norm"]],
)
def test_the_flag_needs_a_budget_and_no_modules(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", *argv])
    assert exit_info.value.code == 2
    assert (
        "--per-module: chooses modules= with the policy for a memory budget; pass "
        "--memory-budget GiB and leave out --modules" in capsys.readouterr().err
    )


def test_the_table_command_runs_on_a_small_case(capsys):
    table_main(["--presets", "tiny-moe:4", "--devices", "h100", "--budgets", "0.01", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model | device | budget GiB |") and len(lines) == 4
    assert lines[3].startswith("| tiny-moe (4 layers) | h100 | 1 | ")
    assert granularity_table(["tiny-moe:4"], ["h100"], [0.01, 1]) == "\n".join(lines)
    with pytest.raises(ValueError, match=r"preset 'tiny:x': expected NAME or NAME:LAYERS"):
        granularity_table(["tiny:x"], ["h100"], [1])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "10", "-1"], "argument --budgets: '-1': expected an amount of memory > 0"),
        (["--budgets", "0"], "argument --budgets: '0': expected an amount of memory > 0"),
        (["--budgets", "x"], "argument --budgets: 'x': expected an amount of memory > 0"),
        (
            ["--presets", "tiny", "huge"],
            "argument --presets: unknown preset 'huge': use one of tiny, llama8b-layer, "
            "mixtral8x7b-layer, tiny-moe.",
        ),
        (
            ["--presets", "tiny:x"],
            "argument --presets: 'tiny:x': expected NAME or NAME:LAYERS with LAYERS in 1..128 "
            "(the policy search's limit), such as tiny:32",
        ),
        (["--presets", "tiny:0"], "argument --presets: 'tiny:0': expected NAME or NAME:LAYERS"),
        (["--presets", "tiny:129"], "argument --presets: 'tiny:129': expected NAME or NAME:"),
        (
            ["--devices", "h100", "tpu"],
            "argument --devices: unknown device profile 'tpu': use one of h100, h200, a100, "
            "gh200, 910b, a JSON file",
        ),
    ],
    ids=["negative", "zero", "text", "preset", "depth", "no-layers", "deep", "device"],
)
def test_the_table_command_refuses_bad_input_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        table_main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("python -m cpu_offload.plan.module_search: error: ")
    assert message in lines[0]


def test_the_table_command_names_a_bad_device_file(tmp_path, capsys):
    path = tmp_path / "device.json"
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        table_main(["--devices", str(path)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"argument --devices: DeviceProfile.from_json: {path}: expected the file to be" in err


def test_the_documented_table_is_the_commands():
    """Rows of docs/planning.md's table, computed again (one model, device and budget
    per row, to stay fast): the table is the command's output, not typed."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    for preset, device, budget in [
        ("mixtral8x7b-layer", "h100", 20),
        ("llama8b-layer:32", "910b", 10),
    ]:
        row = granularity_table([preset], [device], [budget]).splitlines()[2]
        assert row in text
