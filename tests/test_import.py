"""``import cpu_offload`` stays cheap: it leaves ``torch._dynamo`` unloaded (issue 49, item 6),
and the hook modules still go on dynamo's skip list once dynamo is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_leaves_dynamo_unloaded() -> None:
    out = _run(
        """
        import sys
        import cpu_offload
        from cpu_offload import offload_layers, get_cpu_offload_context
        print('torch._dynamo' in sys.modules)
        """
    )
    assert out == "False"


def test_hook_modules_skipped_once_dynamo_is_imported() -> None:
    out = _run(
        """
        import cpu_offload
        import torch._dynamo
        from torch._dynamo import trace_rules
        from cpu_offload.engine import layer_state
        print(trace_rules.check(layer_state.OffloadableLayerState.pop_leased.__code__))
        print(cpu_offload.testing.strict_streams.__name__)
        """
    )
    assert out.splitlines() == ["True", "strict_streams"]


def test_dynamo_imported_first() -> None:
    out = _run(
        """
        import torch._dynamo
        from torch._dynamo import trace_rules
        from cpu_offload.engine import layer_state
        print(trace_rules.check(layer_state.OffloadableLayerState.pop_leased.__code__))
        """
    )
    assert out == "True"
