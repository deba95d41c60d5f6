"""The integration tests' shared fixture: Megatron-Core initialised in the process."""

from __future__ import annotations

import warnings

import pytest
from helpers import load_example
from hosts import require


@pytest.fixture(scope="module")
def megatron():
    """Megatron-Core initialised in this process (gloo, world size 1), torn down after.
    (test_megatron_hybrid.py has its own: it needs megatron-core 0.19 or later.)"""
    require("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    example = load_example("megatron_gpt")
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        device = example.initialize(patch.setattr)
        yield example, device
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
