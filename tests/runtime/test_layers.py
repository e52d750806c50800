"""The layers (docs/architecture.md): imports flow one way,

    flows -> tasks.stages -> tasks.registry, tasks.report -> tasks.data -> tasks.runtime -> crucible

a stage imports no other stage, the library imports no orchestration, and no module imports
itself back through others. Every import counts, at the top of a file or inside a function."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# lower rank = lower layer; a module may import its own layer or any lower one
LAYERS = {
    "crucible": 0,
    "tasks.runtime": 1,
    "tasks.data": 2,
    "tasks.registry": 3,
    "tasks.report": 3,
    "tasks.stages": 4,
    "flows": 5,
}
ORCHESTRATION = ("prefect", "prefect_dask", "prefect_ray", "dvc", "mlflow", "tasks", "flows")


def layer(module: str) -> str | None:
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (`from a import b` counts as a and a.b)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def project_modules(tops=("crucible", "tasks", "flows")) -> dict[str, Path]:
    return {module_name(p): p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {i for i in imports(p) if i in modules and i != m} for m, p in modules.items()}


def violations(modules: dict[str, Path]) -> list[str]:
    out = []
    for m, p in modules.items():
        own = layer(m)
        for imp in sorted(imports(p)):
            if m.startswith("crucible") and imp.split(".")[0] in ORCHESTRATION:
                out.append(f"{m} imports {imp}: the library imports no orchestration")
                continue
            other = layer(imp)
            if own is None or other is None or other == own:
                if (
                    own == other == "tasks.stages"
                    and imp in modules
                    and imp != m
                    and imp != "tasks.stages"
                    and m != "tasks.stages"
                ):
                    out.append(f"{m} imports {imp}: a stage imports no other stage")
                continue
            if LAYERS[other] > LAYERS[own] or (LAYERS[other] == LAYERS[own]):
                out.append(f"{m} ({own}) imports {imp} ({other}): an upward or sideways import")
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (one per back edge)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_imports_flow_one_way():
    assert violations(project_modules()) == []


def test_no_import_cycles():
    edges = graph(project_modules())
    # a package's __init__ importing its own submodules is how a package is made, not a cycle
    edges = {m: {i for i in ups if not m.startswith(i + ".")} for m, ups in edges.items()}
    assert cycles(edges) == []


def test_the_checks_catch_an_upward_import_a_sideways_stage_and_a_cycle(tmp_path, monkeypatch):
    """Guard the guard: a library module importing the runtime, a stage importing another stage and
    two modules importing each other are each reported."""
    for rel, text in {
        "crucible/a.py": "from tasks.runtime import io\n",
        "tasks/stages/one.py": "from tasks.stages.two import run\n",
        "tasks/stages/two.py": "def run(): pass\n",
        "tasks/data/x.py": "import tasks.data.y\n",
        "tasks/data/y.py": "def f():\n    from tasks.data import x\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    mods = project_modules()
    found = violations(mods)
    assert any("crucible.a imports tasks.runtime" in v for v in found)
    assert any("tasks.stages.one imports tasks.stages.two" in v for v in found)
    assert cycles(graph(mods)) == [["tasks.data.x", "tasks.data.y", "tasks.data.x"]]


@pytest.mark.parametrize("top", ["crucible", "tasks", "flows"])
def test_every_module_has_a_layer(top):
    unplaced = [m for m in project_modules((top,)) if layer(m) is None and m not in ("tasks",)]
    assert unplaced == []
