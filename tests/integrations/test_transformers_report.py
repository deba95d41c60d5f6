"""The step report on a real Hugging Face Llama, and a real Trainer's logs with
OffloadCallback: the report's totals against what the pack hooks were handed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hosts import require
from report_truth import Spy, assert_row_matches

from cpu_offload import offload_layers

transformers = require("transformers")

VOCAB = 128


def llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("modules", [None, {"core_attn": "keep"}, ["qkv_linear"]])
@pytest.mark.parametrize("threshold", [0, 4096], ids=["everything", "default-like"])
def test_the_report_of_a_llama_step_is_what_the_hooks_got(monkeypatch, threshold, modules):
    spy = Spy(monkeypatch, threshold)
    model = llama()
    handle = offload_layers(model, 2, min_offload_numel=threshold, modules=modules)
    ids = torch.randint(0, VOCAB, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    report = handle.report()
    assert handle.found == "4 LlamaDecoderLayer at model.layers of LlamaForCausalLM"
    assert [row.counted for row in report.rows] == [True, True, False, False]
    for row in report.rows[:2]:
        assert_row_matches(row, spy)
    if modules is not None:  # what a submodule keeps is counted, under its own reason
        assert report.rows[0].kept_because["kept by modules="][0] > 0
        assert f"modules={modules!r}" in repr(handle)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 8, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, VOCAB, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Later(transformers.TrainerCallback):
    """A callback after OffloadCallback: what its ``logs`` held."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_a_trainer_logs_the_report_under_cpu_offload_keys(tmp_path):
    from cpu_offload.integrations.transformers import OffloadCallback

    callback, later = OffloadCallback(2, min_offload_numel=0), Later()
    assert repr(callback) == "OffloadCallback(2, min_offload_numel=0; not training)"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=3,
    )
    trainer = transformers.Trainer(
        model=llama(), args=args, train_dataset=Tokens(), callbacks=[callback, later]
    )
    trainer.train()
    training_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(training_logs) == 2
    for entry in training_logs:
        assert entry["cpu_offload/saved_tensors"] > entry["cpu_offload/moved_tensors"] > 0
        assert (
            entry["cpu_offload/moved_tensors"] + entry["cpu_offload/kept_tensors"]
            == entry["cpu_offload/saved_tensors"]
        )
        assert "cpu_offload/host_reserved_bytes" in entry
    assert [entry["cpu_offload/step"] for entry in training_logs] == [1, 2]
    assert all("cpu_offload/moved_bytes" in logs for logs in later.logs)
    assert callback.handle is None and callback.report().step == 2  # kept after training
