"""The step report on a real Hugging Face Llama, and a real Trainer's logs with
OffloadCallback: the report's totals against what the pack hooks were handed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import HF_VOCAB, Tokens, tiny_hf_model, trainer_args
from hosts import require
from report_truth import Spy, assert_row_matches

from cpu_offload import offload_layers

transformers = require("transformers")


def llama() -> Any:
    return tiny_hf_model("Llama", 4, max_position_embeddings=64)


@pytest.mark.parametrize("modules", [None, {"core_attn": "keep"}, ["qkv_linear"]])
@pytest.mark.parametrize("threshold", [0, 4096], ids=["everything", "default-like"])
def test_the_report_of_a_llama_step_is_what_the_hooks_got(monkeypatch, threshold, modules):
    spy = Spy(monkeypatch, threshold)
    model = llama()
    handle = offload_layers(model, 2, min_offload_numel=threshold, modules=modules)
    ids = torch.randint(0, HF_VOCAB, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    report = handle.report()
    assert handle.found == "4 LlamaDecoderLayer at model.layers of LlamaForCausalLM"
    assert [row.counted for row in report.rows] == [True, True, False, False]
    for row in report.rows[:2]:
        assert_row_matches(row, spy)
    if modules is not None:  # what a submodule keeps is counted, under its own reason
        assert report.rows[0].kept_because["kept by modules="][0] > 0
        assert f"modules={modules!r}" in repr(handle)


class Later(transformers.TrainerCallback):
    """A callback after OffloadCallback: what its ``logs`` held."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


@pytest.mark.parametrize("log_keys", ["short", "all", "none"])
def test_a_trainer_logs_the_report_under_cpu_offload_keys(tmp_path, log_keys):
    from cpu_offload.integrations.transformers import OffloadCallback

    callback, later = OffloadCallback(2, min_offload_numel=0, log_keys=log_keys), Later()
    said = "" if log_keys == "short" else f", log_keys={log_keys!r}"
    assert repr(callback) == f"OffloadCallback(2{said}, min_offload_numel=0; not training)"
    args = trainer_args(tmp_path, logging_steps=1, gradient_accumulation_steps=2)
    trainer = transformers.Trainer(
        model=llama(), args=args, train_dataset=Tokens(8, 16), callbacks=[callback, later]
    )
    trainer.train()
    training_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in training_logs] == [1, 2]  # the optimizer's steps
    ours = [{k: v for k, v in e.items() if k.startswith("cpu_offload/")} for e in training_logs]
    assert callback.handle is None and callback.report().step == 4  # kept after training
    if log_keys == "none":
        assert ours == [{}, {}] and all("cpu_offload/micro_batch" not in e for e in later.logs)
        return
    # two micro-batches per optimizer step: the report's step counts micro-batches
    assert [entry["cpu_offload/micro_batch"] for entry in ours] == [2, 4]
    assert all("cpu_offload/moved_bytes" in logs for logs in later.logs)
    if log_keys == "short":
        assert all(
            set(entry)
            == {
                "cpu_offload/micro_batch",
                "cpu_offload/moved_bytes",
                "cpu_offload/kept_bytes",
                "cpu_offload/host_reserved_bytes",
            }
            for entry in ours
        ), ours
        assert all(entry["cpu_offload/moved_bytes"] > 0 for entry in ours)
        return
    for entry in ours:
        assert entry["cpu_offload/saved_tensors"] > entry["cpu_offload/moved_tensors"] > 0
        assert (
            entry["cpu_offload/moved_tensors"] + entry["cpu_offload/kept_tensors"]
            == entry["cpu_offload/saved_tensors"]
        )
        assert "cpu_offload/host_reserved_bytes" in entry and "cpu_offload/step" not in entry


def test_log_keys_is_checked():
    from cpu_offload.integrations.transformers import OffloadCallback

    with pytest.raises(ValueError) as raised:
        OffloadCallback(2, log_keys="everything")
    assert str(raised.value) == (
        "OffloadCallback: log_keys must be one of 'short', 'all', 'none' (the report's "
        "scalars each logged line gets), got 'everything'."
    )
