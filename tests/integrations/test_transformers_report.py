"""The step report on a real Hugging Face Llama, and a real Trainer's logs with
OffloadCallback: the report's totals against what the pack hooks were handed."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from hosts import require

from cpu_offload import offload_layers
from cpu_offload.layer_state import OffloadableLayerState
from cpu_offload.selection import PARAMETER, kept_because
from cpu_offload.step_report import REASONS

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


@pytest.mark.parametrize("threshold", [0, 4096], ids=["everything", "default-like"])
def test_the_report_of_a_llama_step_is_what_the_hooks_got(monkeypatch, threshold):
    saved: dict[int, list[tuple[int, str | None]]] = defaultdict(list)
    original = OffloadableLayerState.push_tensor

    def push(state: OffloadableLayerState, tensor: Any) -> Any:
        handle = original(state, tensor)
        if type(tensor) is torch.nn.Parameter:
            why: str | None = PARAMETER
        else:
            why = kept_because(tensor, state.backend.device, threshold)
        saved[state.layer_index].append((tensor.numel() * tensor.itemsize, why))
        return handle

    monkeypatch.setattr(OffloadableLayerState, "push_tensor", push)
    model = llama()
    handle = offload_layers(model, 2, min_offload_numel=threshold)
    ids = torch.randint(0, VOCAB, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    report = handle.report()
    assert handle.found == "4 LlamaDecoderLayer at model.layers of LlamaForCausalLM"
    assert [row.counted for row in report.rows] == [True, True, False, False]
    for row in report.rows[:2]:
        truth = saved[row.index]
        moved = [nbytes for nbytes, why in truth if why is None]
        kept: dict[str, list[int]] = {}
        for nbytes, why in truth:
            if why is not None:
                entry = kept.setdefault(REASONS[why][1], [0, 0])
                entry[0] += 1
                entry[1] += nbytes
        assert (row.saved_tensors, row.saved_bytes) == (len(truth), sum(n for n, _ in truth))
        assert (row.moved_tensors, row.moved_bytes) == (len(moved), sum(moved))
        assert row.kept_because == {reason: (t, b) for reason, (t, b) in kept.items()}
    stats = handle.offload_synchronizer.stats
    scalars = report.to_dict()
    assert scalars["moved_tensors"] + scalars["kept_tensors"] == scalars["saved_tensors"]
    assert scalars["moved_bytes"] + scalars["kept_bytes"] == scalars["saved_bytes"]
    assert scalars["copied_bytes"] == stats.bytes_offloaded  # one step: the running totals
    assert scalars["moved_tensors"] >= stats.tensors_offloaded > 0  # views, saved twice
    if threshold:
        assert scalars["kept_tensors/threshold"] > 0
    handle.remove()


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
