"""Every Python block of the README and docs/ runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hosts import require

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{doc.name}-{index}")
    for doc in DOCS
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))
]


HOSTS = ("transformers", "torchtune", "peft", "megatron")


@pytest.mark.parametrize("block", BLOCKS)
def test_doc_block_runs(block):
    for host in HOSTS:  # a block using a host library needs it installed
        if re.search(rf"^\s*(import|from) {host}\b", block, re.M):
            require(host)
    exec(compile(block, "<doc>", "exec"), {"__name__": "__doc_example__"})


def test_there_are_doc_blocks():
    assert len(BLOCKS) >= 4
