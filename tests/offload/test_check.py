"""``python -m cpu_offload.check``: the table, the exit status, the JSON, the device rows."""

from __future__ import annotations

import json

import pytest
import torch

from cpu_offload import OffloadableLayerState, check
from cpu_offload.device.runtime import get_backend
from cpu_offload.testing import strict_runtime


def rows(out: str) -> dict[str, tuple[str, str]]:
    """Table rows by name: (status, detail)."""
    table = {}
    for line in out.splitlines():
        for status in (check.PASS, check.FAIL, check.NOT_RUN):
            if line.startswith(f"{status:<8} "):
                name, _, detail = line[9:].partition("  ")
                table[name.strip()] = (status, detail.strip())
    return table


def test_on_the_cpu_it_runs_what_it_can_and_says_what_it_did_not(capsys, tmp_path):
    path = tmp_path / "check.json"
    assert check.main(["--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    assert table["gradients bit-identical on cpu"][0] == check.PASS
    assert table["Float8 offload round trip"][0] == check.PASS
    assert table["MXFP8 offload round trip"][0] == check.PASS
    assert table["simulated CUDA runtime (strict)"][0] == check.PASS
    assert table["simulated NPU runtime (strict)"][0] == check.PASS
    assert table["end-of-forward memory = (L-k)*T"] == (
        check.NOT_RUN,
        "cpu reports no device memory",
    )
    assert table["copy bandwidth vs raw pinned copy"] == (
        check.NOT_RUN,
        "no host-device link on a CPU-only machine",
    )
    assert "the device rows were not run" in out
    written = json.loads(path.read_text())
    assert written["environment"]["torch"] == torch.__version__
    assert [r["status"] for r in written["checks"]].count(check.PASS) == 5


def test_wrong_gradients_fail_and_the_exit_status_says_so(capsys, monkeypatch):
    original = OffloadableLayerState.pop_leased

    def corrupting_pop(self, lease, index, prefetch=True):
        return original(self, lease, index, prefetch) * 2  # a reload bringing back wrong values

    monkeypatch.setattr(OffloadableLayerState, "pop_leased", corrupting_pop)
    assert check.main(["--device", "cpu"]) == 1
    status, detail = rows(capsys.readouterr().out)["gradients bit-identical on cpu"]
    assert status == check.FAIL and "k=1: " in detail and " differ" in detail


def test_a_check_that_raises_is_a_failure_with_the_error(capsys, monkeypatch):
    def broken(backend):
        raise RuntimeError("no such stream")

    monkeypatch.setattr(check, "check_host_syncs", broken)
    assert check.main(["--device", "cpu"]) == 1
    table = rows(capsys.readouterr().out)
    assert table["host syncs"] == (check.FAIL, "raised RuntimeError: no such stream")


def test_host_syncs_through_the_accelerator_backend():
    """The device path of the sync row, on the simulated runtimes."""
    with strict_runtime("cuda"):
        result = check.check_host_syncs(get_backend("cpu"))
    assert (result.status, result.detail) == (check.PASS, "0 synchronising calls")
    with strict_runtime("npu"):
        result = check.check_host_syncs(get_backend("cpu"))
    assert result.status == check.NOT_RUN
    assert result.detail == "the npu runtime does not report synchronisations to Python"


def test_check_help_is_plain_text_and_every_flag_says_its_default(capsys):
    with pytest.raises(SystemExit) as exited:
        check.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text
    assert "python -m cpu_offload.check: the first command to run" in " ".join(text.split())
    options = text.split("options:")[1]
    for flag in ("--device", "--json", "--full", "--simulate"):
        assert flag in options
    assert options.count("(default:") == 4  # every flag but --help
