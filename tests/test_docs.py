"""Every Python block of the README and docs/ runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{doc.name}-{index}")
    for doc in DOCS
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))
]


@pytest.mark.parametrize("block", BLOCKS)
def test_doc_block_runs(block):
    exec(compile(block, "<doc>", "exec"), {"__name__": "__doc_example__"})


def test_there_are_doc_blocks():
    assert len(BLOCKS) >= 4
