"""``max_host_bytes`` as bytes, a string with its unit, or ``"auto"`` (issue 42, part 2):
the node's available memory (or its cgroup's) times a fraction, shared by its ranks;
reported as ``host_cap_bytes`` in ``report().to_dict()`` and in the reprs."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import get_cpu_offload_context, offload_layers
from cpu_offload.device import host_cap as host_cap_module
from cpu_offload.device.host_cap import (
    AUTO_HOST_FRACTION,
    auto_host_cap,
    cgroup_memory_available,
    host_cap_bytes,
    local_world_size,
)
from cpu_offload.integrations import megatron as megatron_offload
from cpu_offload.integrations.torchtune import OffloadActivations

GiB = 2**30


def _files(tmp_path, available_kb: int, **cgroup: str):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    root = tmp_path / "cgroup"
    for name, text in cgroup.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(meminfo), str(root)


def test_auto_is_a_fraction_of_mem_available_divided_by_the_local_ranks(tmp_path):
    meminfo, root = _files(tmp_path, 16 * 2**20)  # 16 GiB, no cgroup
    cap = auto_host_cap(meminfo, root, {"LOCAL_WORLD_SIZE": "8"})
    assert cap == int(16 * GiB * AUTO_HOST_FRACTION) // 8
    assert auto_host_cap(meminfo, root, {}) == int(16 * GiB * AUTO_HOST_FRACTION)


def test_auto_takes_the_cgroup_v2_limit_where_it_is_lower(tmp_path):
    meminfo, root = _files(
        tmp_path, 16 * 2**20, **{"memory.max": str(6 * GiB), "memory.current": str(2 * GiB)}
    )
    assert cgroup_memory_available(root) == 4 * GiB
    assert (
        auto_host_cap(meminfo, root, {"LOCAL_WORLD_SIZE": "2"})
        == int(4 * GiB * AUTO_HOST_FRACTION) // 2
    )


def test_auto_takes_the_cgroup_v1_limit_and_ignores_no_limit(tmp_path):
    meminfo, root = _files(
        tmp_path,
        16 * 2**20,
        **{
            "memory.max": "max",
            "memory__memory.limit_in_bytes": str(3 * GiB),
            "memory__memory.usage_in_bytes": str(GiB),
        },
    )
    assert cgroup_memory_available(root) == 2 * GiB
    assert auto_host_cap(meminfo, root, {}) == int(2 * GiB * AUTO_HOST_FRACTION)
    (tmp_path / "none").mkdir()
    meminfo, root = _files(tmp_path / "none", 16 * 2**20, **{"memory.max": "max"})
    assert cgroup_memory_available(root) is None


@pytest.mark.parametrize("text, ranks", [(None, 1), ("", 1), ("4", 4), (" 8 ", 8)])
def test_local_world_size_is_torchruns_or_one(text, ranks):
    assert local_world_size({"LOCAL_WORLD_SIZE": text} if text is not None else {}) == ranks


@pytest.mark.parametrize("text", ["0", "-1", "abc", "2.5"])
def test_a_local_world_size_that_is_no_rank_count_is_refused_naming_it(text, tmp_path):
    meminfo, root = _files(tmp_path, 16 * 2**20)
    with pytest.raises(ValueError) as raised:
        auto_host_cap(meminfo, root, {"LOCAL_WORLD_SIZE": text})
    message = str(raised.value)
    assert f"found LOCAL_WORLD_SIZE={text!r}" in message
    assert "expected a whole number >= 1" in message and "max_host_bytes='auto'" in message


def test_a_bad_local_world_size_is_refused_where_the_offloader_is_made(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"found LOCAL_WORLD_SIZE='0'\. Set it to the ranks"):
        get_cpu_offload_context(True, 1, 2, max_host_bytes="auto")
    get_cpu_offload_context(True, 1, 2, max_host_bytes="1GiB")  # a given cap reads no ranks


@pytest.mark.parametrize(
    "value, expected",
    [
        ("64GiB", 64 * GiB),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4096B", 4096),
        (2**20, 2**20),
    ],
    ids=str,
)
def test_strings_mean_what_they_mean_for_memory_budget(value, expected):
    assert host_cap_bytes(value) == expected


def test_a_string_that_is_no_size_is_refused_with_the_forms():
    with pytest.raises(
        ValueError, match=r"max_host_bytes='lots' is not a size; give .*'auto' \(the node's"
    ):
        get_cpu_offload_context(True, 1, 2, max_host_bytes="lots")


@pytest.fixture
def node(monkeypatch):
    """A node with 10 GiB available, no cgroup limit, 4 ranks."""
    monkeypatch.setattr(host_cap_module, "host_memory_available", lambda meminfo: 10 * GiB)
    monkeypatch.setattr(host_cap_module, "cgroup_memory_available", lambda root: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    return int(10 * GiB * AUTO_HOST_FRACTION) // 4


def _step(layers):
    x = torch.randn(8, 16, requires_grad=True)
    for layer in layers:
        x = layer(x)
    x.sum().backward()


def test_the_report_and_the_reprs_say_the_cap(node):
    ctx, sync_fn = get_cpu_offload_context(True, 1, 2, min_offload_numel=0, max_host_bytes="auto")
    assert f"max_host_bytes='auto', host_cap_bytes={node}" in repr(ctx)
    layers = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)]
    x = torch.randn(8, 16, requires_grad=True)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync_fn(x)
    x.sum().backward()
    assert ctx.offload_synchronizer.report().to_dict()["host_cap_bytes"] == node
    handle = offload_layers(layers, 1, min_offload_numel=0, max_host_bytes="64MiB")
    assert "host_cap_bytes=67108864" in repr(handle)
    _step(layers)
    assert handle.report().to_dict()["host_cap_bytes"] == 64 * 2**20
    handle.remove()


def test_no_cap_reports_none(node):
    handle = offload_layers([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)], 1)
    assert "max_host_bytes=None" in repr(handle) and "host_cap_bytes" not in repr(handle)
    handle.remove()


def test_offload_activations_takes_the_same_forms(node):
    assert f"host_cap_bytes={node}" in repr(OffloadActivations(max_host_bytes="auto"))
    assert "host_cap_bytes=1073741824" in repr(OffloadActivations(max_host_bytes="1GiB"))


def test_the_megatron_wrapper_takes_the_same_forms(node):
    context, _ = megatron_offload.get_cpu_offload_context(
        True, 1, 4, True, False, False, False, max_host_bytes="auto"
    )
    assert context.offload_synchronizer.host_buffers.max_bytes == node
    patch = megatron_offload.patch(max_host_bytes="2GiB")
    try:
        context, _ = patch.function(True, 1, 4, True, False)
    finally:
        patch.remove()
    assert context.offload_synchronizer.host_buffers.max_bytes == 2 * GiB


def test_the_trainer_callback_takes_the_same_forms(node):
    pytest.importorskip("transformers")
    from cpu_offload.integrations.transformers import OffloadCallback

    callback = OffloadCallback(1, min_offload_numel=0, max_host_bytes="auto")
    layers = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)])
    callback.on_train_begin(None, None, None, model=layers)
    try:
        assert f"host_cap_bytes={node}" in repr(callback.handle)
        _step(layers)
        assert callback.report().to_dict()["host_cap_bytes"] == node
    finally:
        callback.on_train_end(None, None, None)
