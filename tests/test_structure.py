"""The house rules of docs/design.md ("The rule for later"), checked on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cpu_offload", "quantized")
CORE_MODULE_LINES, CLASS_LINES = 450, 250


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str]]:
    """``(module, imported name)`` for every import of the package's own modules, type
    hints' imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.append((target, alias.name))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names)
    return [(t, n) for t, n in found if t.split(".")[0] in PACKAGES]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, imported in _imports(name, path):
            if f"{target}.{imported}" in MODULES:
                graph[name].add(f"{target}.{imported}")
            elif target in MODULES:
                graph[name].add(target)
    return graph


def test_no_module_imports_another_modules_private_name():
    private = [
        f"{name} imports {imported} from {target}"
        for name, path in MODULES.items()
        for target, imported in _imports(name, path)
        if imported.startswith("_") and not imported.startswith("__") and target != name
    ]
    assert private == []


def test_no_import_cycle():
    graph, cycles = _graph(), []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                cycles.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", [n for n in MODULES if n.count(".") == 1], ids=str)
def test_modules_and_classes_are_small(name):
    path = MODULES[name]
    source = path.read_text()
    if name.startswith("cpu_offload.") and path.parent.name == "cpu_offload":
        assert len(source.splitlines()) <= CORE_MODULE_LINES, f"{name} is a core module"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= CLASS_LINES, f"{name}.{node.name}"


def test_only_device_py_calls_a_device_runtime():
    runtimes = {"cuda", "npu", "xpu", "accelerator"}
    callers = set()
    for name, path in MODULES.items():
        if name == "cpu_offload.device.runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in runtimes
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                callers.add(name)
    # the simulated runtime and the modeled cuda (which unmodified GPU programs call)
    # stand in for torch.cuda; the benchmark's peer row and quantized/'s FP8 capability
    # check go through device.py's helpers
    assert callers <= {"cpu_offload.testing.runtime", "cpu_offload.testing.modeled_cuda"}, callers


def test_importing_the_core_loads_no_package_beside_it():
    """Packages beside the core (the planner, the benchmark, the testing tools, the
    integrations) import the core, never the reverse: ``import cpu_offload`` loads none of
    them (the core reaches the planner lazily, for a memory budget)."""
    code = (
        "import sys, cpu_offload\n"
        "beside = ('cpu_offload.plan', 'cpu_offload.bench', 'cpu_offload.integrations')\n"
        "print(sorted(m for m in sys.modules if m.startswith(beside)))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert found.stdout.strip() == "[]", found.stdout
