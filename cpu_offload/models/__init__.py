"""Small decoder models shared by the demo, the benchmark, the check, the planner, the
examples and the tests; not part of the offloader.

- :mod:`cpu_offload.models.gpt`: a GPT-style stack of pre-norm blocks (``Block``).
- :mod:`cpu_offload.models.llama`: a Llama-style stack (RMSNorm, RoPE, GQA, SwiGLU).
- :mod:`cpu_offload.models.moe`: a mixture-of-experts variant of it.
- :mod:`cpu_offload.models.presets`: named shapes the benchmark and the planner build.

May import: hooks.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES"]

#: the dtypes the commands (demo, benchmark, planner) accept, by name
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
