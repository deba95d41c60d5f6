"""The compiled-layer tests: torch on one thread (inductor on a CPU is deterministic there,
so compiled programs with and without offload can be compared bit for bit), and dynamo's
caches reset around each test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)
