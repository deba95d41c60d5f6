"""Small decoder models shared by the demo, the benchmark, the check, the planner, the
examples and the tests; not part of the offloader.

- :mod:`cpu_offload.models.gpt`: a GPT-style stack of pre-norm blocks (``Block``).
- :mod:`cpu_offload.models.llama`: a Llama-style stack (RMSNorm, RoPE, GQA, SwiGLU).
"""
