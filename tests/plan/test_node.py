"""The planner per node (issue 42, part 4): ``--ranks-per-node N --host-memory G``: host
bytes per rank and per node in the JSON and the table; a small node pushes the policy
towards checkpointing; ``--memory-budget`` alone keeps its answer."""

from __future__ import annotations

import argparse
import json

import pytest

from cpu_offload.engine.host_buffers import pool_reserve
from cpu_offload.plan.__main__ import main
from cpu_offload.plan.node import Node, host_memory_argument
from cpu_offload.policy.policy import CHECKPOINTED, OFFLOADED

GIB = 2**30
BUDGET = "0.045"  # GiB: the tiny preset's 4 layers fit it by offloading two


def test_a_node_holds_its_ranks_shares():
    node = Node(8, 256 * GIB)
    assert node.cap_per_rank == 32 * GIB
    assert node.per_rank(10 * GIB) == pool_reserve(10 * GIB) == 10 * GIB + 10 * GIB // 16
    assert node.per_node(10 * GIB) == 8 * pool_reserve(10 * GIB)
    assert node.fits(30 * GIB) and not node.fits(31 * GIB)
    assert Node().fits(10**15) is None and Node().cap_per_rank is None


@pytest.mark.parametrize(
    "text, nbytes", [("256", 256 * GIB), ("0.5", GIB // 2), ("1TiB", 2**40), ("64 GB", 64 * 10**9)]
)
def test_host_memory_is_gib_or_a_string_with_its_unit(text, nbytes):
    assert host_memory_argument(text) == nbytes


@pytest.mark.parametrize("text", ["0", "-1", "lots", "inf"])
def test_a_bad_host_memory_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected GiB of host memory per node"):
        host_memory_argument(text)


def _plan(tmp_path, capsys, *flags: str) -> tuple[dict, str]:
    path = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
    assert main(["--preset", "tiny", "--memory-budget", BUDGET, *flags, "--json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_a_small_node_pushes_the_policy_to_checkpointing(tmp_path, capsys):
    alone, _ = _plan(tmp_path, capsys)
    ranks, _ = _plan(tmp_path, capsys, "--ranks-per-node", "8")
    big, _ = _plan(tmp_path, capsys, "--ranks-per-node", "8", "--host-memory", "1TiB")
    small, table = _plan(tmp_path, capsys, "--ranks-per-node", "8", "--host-memory", "0.16")
    # --memory-budget alone, or without the node's memory, or on a large node: one answer
    assert alone["policy"] == ranks["policy"] == big["policy"]
    assert any(c in OFFLOADED for c in alone["policy"]) and alone["policy_fits"]
    assert alone["host_fits"] is None and alone["ranks_per_node"] == 1
    moved = alone["policy_predicted"]["offloaded_bytes_per_step"]
    assert alone["host_bytes_per_rank"] == alone["host_bytes_per_node"] == pool_reserve(moved)
    assert ranks["host_bytes_per_node"] == 8 * ranks["host_bytes_per_rank"]
    assert big["host_fits"] is True and big["host_memory_bytes"] == 2**40
    # a node of 0.16 GiB for 8 ranks (20 MiB each) cannot hold two layers per rank
    cap = int(0.16 * GIB) // 8
    assert alone["host_bytes_per_rank"] > cap
    assert small["host_bytes_per_rank"] <= cap and small["host_fits"] is True
    assert small["host_bytes_per_node"] == 8 * small["host_bytes_per_rank"]
    assert sum(c in CHECKPOINTED for c in small["policy"]) > sum(
        c in CHECKPOINTED for c in alone["policy"]
    )
    assert small["rows"][1]["host_bytes_per_node"] == 8 * small["rows"][1]["host_bytes_per_rank"]
    assert "host GiB/node" in table and "x 8 ranks" in table and ": fits" in table
    assert "GiB of host memory per rank" in table
