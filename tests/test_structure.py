"""The house rules of docs/design.md ("The rule for later"), checked on the source."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cpu_offload", "quantized")
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 450, 250, 100
#: the offloader's mechanism, one folder per concept (docs/design.md)
MECHANISM = ("device", "hooks", "report", "engine", "policy", "graphs")
#: the packages beside the core: they import it, it reaches them lazily if at all
BESIDE = ("plan", "bench", "testing", "models", "integrations")
TOP_LEVEL_MODULES, FOLDER_MODULES = 12, 15


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


@pytest.mark.parametrize("name", list(MODULES), ids=str)
def test_modules_and_classes_are_small(name):
    """Every module of the package: at most 450 lines, its classes at most 250 (a long
    docstring counts; issue 54 extended the rule from the core to the whole package)."""
    path = MODULES[name]
    source = path.read_text()
    assert len(source.splitlines()) <= MODULE_LINES, f"{name}: {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= CLASS_LINES, f"{name}.{node.name}"


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, its docstring left out."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_is_longer_than_100_lines():
    long = [
        f"{name}.{node.name}: {_code_lines(node)} lines"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and _code_lines(node) > FUNCTION_LINES
    ]
    assert long == []


def _folders() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "cpu_offload").glob("*/__init__.py"))


def test_the_top_level_holds_the_entry_points():
    top = sorted(p.name for p in (ROOT / "cpu_offload").glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top


def test_the_mechanism_is_in_folders_of_at_most_15_modules():
    """Every folder of the package, nested ones too: at most 15 modules, its
    ``__init__.py`` and ``__main__.py`` counted."""
    folders = [p.name for p in _folders()]
    assert sorted(folders) == sorted(MECHANISM + BESIDE), "a new folder: add it above"
    assert len(MECHANISM) >= 4
    for package in PACKAGES:
        for init in sorted((ROOT / package).rglob("__init__.py")):
            modules = sorted(p.name for p in init.parent.glob("*.py"))
            assert len(modules) <= FOLDER_MODULES, f"{init.parent.relative_to(ROOT)}: {modules}"


def _plan_rooms() -> tuple[dict[str, str], dict[str, set[str]]]:
    """The rooms of ``plan/`` as its ``__init__.py`` draws them: each module's room, and
    the other rooms each may import."""
    doc = ast.get_docstring(ast.parse((ROOT / "cpu_offload/plan/__init__.py").read_text()))
    rows = re.findall(r"^    (\w+): (.+?) -> (.+)$", doc or "", flags=re.MULTILINE)
    assert rows, "cpu_offload/plan/__init__.py: no map of rooms"
    room_of, allowed = {}, {}
    for room, modules, imports in rows:
        allowed[room] = set(imports.split()) - {"nothing"}
        for module in modules.split():
            name = "cpu_offload.plan." + module.rstrip("/")
            found = [n for n in MODULES if n == name or n.startswith(name + ".")]
            assert found, f"plan's map names {module}, which is not there"
            room_of.update((n, room) for n in found if n == name or module.endswith("/"))
    return room_of, allowed


def test_every_room_of_the_planner_imports_only_what_its_map_allows():
    room_of, allowed = _plan_rooms()
    plan = [n for n in MODULES if n.startswith("cpu_offload.plan.")]
    assert sorted(set(plan) - set(room_of)) == [], "a module of plan/ in no room of its map"
    assert set(room_of.values()) >= {r for rooms in allowed.values() for r in rooms}
    wrong = [
        f"{name} ({room_of[name]}) imports {target} ({room_of[target]})"
        for name in plan
        for target in _graph()[name]
        if target in room_of
        and room_of[target] != room_of[name]
        and room_of[target] not in allowed[room_of[name]]
    ]
    assert wrong == []


def _unit(name: str) -> str | None:
    """What a module of cpu_offload belongs to: its folder, or itself at the top level."""
    parts = name.split(".")
    if parts[0] != "cpu_offload":
        return None
    return parts[1] if len(parts) > 1 else "cpu_offload"


def _unit_graph() -> dict[str, set[str]]:
    """Folders and top-level modules, and which of them each imports (lazily too)."""
    graph: dict[str, set[str]] = {}
    for name, targets in _graph().items():
        unit = _unit(name)
        if unit is not None:
            graph.setdefault(unit, set()).update(
                t for t in map(_unit, targets) if t is not None and t != unit
            )
    return graph


def _may_import(folder: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    paragraph = doc.partition("May import:")[2].split("\n\n")[0]
    assert paragraph, f"{folder.name}/__init__.py: no 'May import:' paragraph"
    names = {n.strip() for n in paragraph.replace("\n", " ").rstrip(" .").split(",")}
    return names - {"nothing"}


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_every_folder_says_what_it_holds_and_what_it_may_import(folder):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    assert len(doc.split("May import:")[0].split()) >= 8, f"{folder.name}: what does it hold?"
    allowed = _may_import(folder)
    units = {p.name for p in _folders()} | {
        p.stem for p in (ROOT / "cpu_offload").glob("*.py") if p.name != "__init__.py"
    }
    assert allowed <= units, f"{folder.name} names what is not there: {allowed - units}"
    imported = _unit_graph().get(folder.name, set())
    assert imported <= allowed, f"{folder.name} imports {sorted(imported - allowed)}"


def test_folders_import_one_another_without_cycles():
    graph, cycles = _unit_graph(), []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for other in sorted(graph.get(unit, ())):
            if state.get(other) == 1:
                cycles.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, [*path, other])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])
    assert cycles == []


def test_nothing_that_runs_during_training_imports_the_benchmark():
    """The benchmark measures the offloader; the offloader never needs it (the link's
    measurement is the device's: ``device/link.py``)."""
    importers = sorted(u for u, targets in _unit_graph().items() if "bench" in targets)
    assert importers == []


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
    # check go through device/runtime.py's helpers
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
