"""Every Python block of the README and docs/ runs."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
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
#: an example that calls one of these offloads something, and must print what moved
OFFLOADING = re.compile(
    r"get_cpu_offload_context|offload_layers\(|OffloadCallback\(|get_act_offloading_ctx_manager|"
    r"OffloadSynchronizer\(|OffloadActivations\(|ChunkedOffload\("
)
MOVED = re.compile(r"(?:moved|copied) ([1-9]\d*) tensors \((\d+\.\d+) MiB\) to the host")


@pytest.mark.parametrize("block", BLOCKS)
def test_doc_block_runs(block):
    for host in HOSTS:  # a block using a host library needs it installed
        if re.search(rf"^\s*(import|from) {host}\b", block, re.M):
            require(host)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        # An example that moves nothing (every tensor under the threshold) teaches nothing.
        warnings.filterwarnings("error", "cpu_offload: a forward pass offloaded nothing")
        warnings.filterwarnings("error", "cpu_offload: .* moved nothing to the host")
        exec(compile(block, "<doc>", "exec"), {"__name__": "__doc_example__"})
    if OFFLOADING.search(block):
        assert MOVED.search(out.getvalue()), f"the example prints no bytes moved: {out.getvalue()}"


def test_there_are_doc_blocks():
    assert len(BLOCKS) >= 4


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_and_image_of_the_docs_is_in_the_repository():
    """A link to a file that is not tracked (an ignored plot, say) dangles on every checkout."""
    import subprocess

    tracked = set(
        subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    )
    dangling = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve().relative_to(ROOT).as_posix()
            if path not in tracked and not any(t.startswith(path + "/") for t in tracked):
                dangling.append(f"{doc.name}: {target}")
    assert not dangling, dangling


def test_the_readme_says_what_this_is_and_how_to_run_it_on_its_first_screen():
    """What the tool does and for whom, the CPU torch note above the two commands (the test
    command installs every host library its count covers), an example on a Hugging Face
    model that prints its report, the memory budget: what it counts and what "auto" is, and
    that no prediction has been checked on a GPU at the torch version CI runs."""
    first = (ROOT / "README.md").read_text().splitlines()[:45]
    text = "\n".join(first)
    assert "moves the activations" in text and "for training whose activations" in text
    note = next(i for i, line in enumerate(first) if "pip install torch==" in line)
    commands = [i for i, line in enumerate(first) if line.startswith("pip install -e ")]
    assert len(commands) == 2 and note < commands[0]
    assert "python -m cpu_offload " in first[commands[0]]
    assert '".[test,bench,integrations,peers]" && python -m pytest' in first[commands[1]]
    assert re.search(r"\d+ passed, \d+ skipped", first[commands[1]])
    assert "from transformers import" in text and "print(handle.report())" in text
    assert 'offload_layers(model, memory_budget="' in text
    assert "on\ntop of what the step starts with (weights, gradients, optimizer state)" in text
    assert '`memory_budget="auto"` is the device\'s free memory' in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text  # not a CUDA build
    torch_ci = re.search(r"torch==(\d+\.\d+)", (ROOT / ".ci" / "run").read_text())[1]
    assert f"none has been\nchecked on a GPU at torch {torch_ci}" in text
