"""A stage's one declaration, and everything derived from it: dvc.yaml, the flow's DAG, the files
a stage reads and writes (for its lineage tags), and the params it may read.

Each module in tasks/stages/ declares `SPEC = StageSpec(...)`: the data it reads (`deps`), the
params keys it reads (`params`), what it writes (`outs`, `metrics`, `plots`). Paths and keys may
hold `{task}`, the stage's task when it runs per task. The code a stage runs is not declared: it
is the stage module and every module of tasks.data / tasks.registry / tasks.report / crucible
that it imports, directly or through them (found from the source, so it cannot drift).

    crucible dag write     # dvc.yaml from the declarations (a test fails when it is stale)
    crucible dag show      # the stages, their edges and their code
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

PROJECT = Path(__file__).resolve().parents[2]
# the code a stage's result depends on: the method (crucible) and the shared readers and writers it
# uses; the runtime (params, tracking, locks) and the orchestration are not part of the result
CODE_PACKAGES = ("tasks.stages", "tasks.data", "tasks.registry", "tasks.report", "crucible")


@dataclass(frozen=True)
class Plot:
    """A DVC plot output (not cached): `x`, `y` and `template` as dvc.yaml's plot options."""

    path: str
    x: str | None = None
    y: str | None = None
    template: str | None = None


@dataclass(frozen=True)
class StageSpec:
    """What a stage reads and writes, stated once. `outs` are cached by DVC; `metrics`, `plots`
    and `uncached` are not (small files, or files the registry holds). `comment` heads the stage in
    dvc.yaml."""

    name: str
    per_task: bool
    comment: str
    deps: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    uncached: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    plots: tuple[Plot, ...] = ()
    # a params key that switches the stage on; switched off, it writes only a note (the DAG is the
    # same either way) and takes no cores
    switch: str | None = None
    module: str = field(default="", compare=False)

    def written(self) -> tuple[str, ...]:
        """Every path the stage writes (files or folders), `{task}` unexpanded."""
        return (*self.outs, *self.uncached, *self.metrics, *(p.path for p in self.plots))

    def sid(self, task: str | None) -> str:
        """The DVC name of one run of the stage: 'ingest@bbc' for a per-task stage."""
        return self.name if task is None else f"{self.name}@{task}"


def expand(template: str, task: str | None) -> str:
    return template.replace("{task}", task) if task is not None else template


def files_under(root: Path, rel: str) -> list[Path]:
    """`rel` (a file or a folder under `root`) as the files that exist, relative to `root`, sorted;
    hidden files are skipped (DVC's own and scratch files)."""
    path = root / rel
    if path.is_file():
        return [Path(rel)]
    if path.is_dir():
        return sorted(
            p.relative_to(root)
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    return []


def expand_deps(spec: StageSpec, task: str | None, tasks) -> list[str]:
    """The stage's declared deps for one run: `{task}` is the run's task in a per-task stage, and in
    a stage over all tasks each of `tasks` (pipeline.tasks) in turn, so that merge depends on
    exactly every task's fine-tune and splits, and on nothing else under data/."""
    out = []
    for d in spec.deps:
        out += [expand(d, t) for t in tasks] if "{task}" in d and not spec.per_task else [expand(d, task)]
    return out


def inputs(spec: StageSpec, task: str | None, root: Path, tasks=()) -> list[Path]:
    """The data files the stage reads that exist now (a declared folder gives its files)."""
    return [p for d in expand_deps(spec, task, tasks) for p in files_under(root, d)]


def outputs(spec: StageSpec, task: str | None, root: Path) -> list[Path]:
    """The files the stage wrote (a declared folder gives the files in it)."""
    return [p for w in spec.written() for p in files_under(root, expand(w, task))]


def output_dirs(spec: StageSpec, task: str | None) -> set[Path]:
    """The folders the stage writes into (where a killed run's temporary files would be)."""
    out = set()
    for w in spec.written():
        p = PurePosixPath(expand(w, task))
        out.add(Path(p) if not p.suffix else Path(p.parent))
    return out


def params_keys(spec: StageSpec, task: str | None, params) -> tuple[str, ...]:
    """The stage's params keys for `task`, a `${key}` in them replaced by that param's value (as
    DVC's dvc.yaml templating does: `finetune.${finetune.method}`)."""

    def value(match: re.Match) -> str:
        obj = params
        for part in match.group(1).split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
        return str(obj)

    return tuple(re.sub(r"\$\{([a-z_][a-z0-9_.]*)\}", value, expand(k, task)) for k in spec.params)


# ---------------------------------------------------------------------------------------------------
# code dependencies, from the imports in the source


def _module_file(name: str) -> Path | None:
    """The project's source file of a module name (no import: names found in the source may be a
    function imported from a module, which have no file)."""
    base = PROJECT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path, package: str) -> set[str]:
    """Every module the file imports, at top level or inside a function, as absolute names."""
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
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def _in_scope(name: str, module: str) -> bool:
    if name == "tasks.stages" or name.startswith("tasks.stages."):
        return name == module  # a stage imports no other stage (tests/runtime/test_layers.py)
    return any(name == p or name.startswith(p + ".") for p in CODE_PACKAGES)


def code_modules(module: str) -> list[str]:
    """`module` and every in-scope module it imports, transitively (a package's __init__ too)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or not _in_scope(name, module):
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen.add(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages run first
        todo.extend(_imports(path, package))
    return sorted(seen)


def code_deps(module: str) -> list[str]:
    """The source files of `code_modules(module)` relative to the project; a folder stands for
    itself when every file in it (and below it) is a dependency."""
    files = set()
    for name in code_modules(module):
        path = _module_file(name)
        if path.name == "__init__.py" and _only_docstring(path):
            continue  # a package's empty __init__ changes no result
        files.add(path.relative_to(PROJECT).as_posix())
    return _collapse(files)


def _only_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def _collapse(files: set[str]) -> list[str]:
    by_dir: dict[str, set[str]] = {}
    for f in files:
        by_dir.setdefault(str(PurePosixPath(f).parent), set()).add(f)
    out = set(files)
    # deepest folders first, so a folder whose subfolders are all whole collapses too
    for d in sorted(by_dir, key=lambda d: -d.count("/")):
        if d in ("tasks", "crucible", "."):
            continue
        every = {
            p.relative_to(PROJECT).as_posix()
            for p in (PROJECT / d).rglob("*.py")
            if "__pycache__" not in p.parts and not (p.name == "__init__.py" and _only_docstring(p))
        }
        if every and every <= files:
            out = {f for f in out if not f.startswith(d + "/")} | {d}
    return sorted(out)


# ---------------------------------------------------------------------------------------------------
# dvc.yaml


def _dvc_path(template: str) -> str:
    return template.replace("{task}", "${key}")


def dvc_stage(spec: StageSpec, extra_code: tuple[str, ...] = (), tasks=()) -> dict:
    """The dvc.yaml entry of one stage (the body under `do:` for a per-task stage). A stage over all
    tasks lists its per-task deps for each of `tasks`; DVC cannot loop inside a deps list, so
    dvc.yaml follows pipeline.tasks (`crucible dag write` rewrites it, `crucible run` and a
    profile's workspace do so on their own, and a stage under `dvc repro` refuses a stale one)."""
    body: dict = {"cmd": f"crucible stage {spec.name}" + (" --task ${key}" if spec.per_task else "")}
    code = code_deps(spec.module)
    code += [p for p in extra_code if not any(_overlaps(p, c) for c in code)]
    deps = spec.deps if spec.per_task else expand_deps(spec, None, tasks)
    body["deps"] = [*code, *map(_dvc_path, deps)]
    if spec.params:
        body["params"] = [_dvc_path(k) for k in spec.params]
    outs = [_dvc_path(p) for p in spec.outs] + [{_dvc_path(p): {"cache": False}} for p in spec.uncached]
    if outs:
        body["outs"] = outs
    if spec.metrics:
        body["metrics"] = [{_dvc_path(p): {"cache": False}} for p in spec.metrics]
    if spec.plots:
        body["plots"] = [
            {
                _dvc_path(p.path): {
                    "cache": False,
                    **{k: v for k, v in (("template", p.template), ("x", p.x), ("y", p.y)) if v is not None},
                }
            }
            for p in spec.plots
        ]
    return {"foreach": "${pipeline.tasks}", "do": body} if spec.per_task else body


HEADER = """\
# GENERATED by `crucible dag write` from the stages' declarations (SPEC in tasks/stages/*.py):
# edit those and rerun it; a test fails when this file is stale. Each stage lists the code it runs
# (found from its imports), the data it reads, the params it reads and what it writes; `foreach`
# runs a stage per task, and a stage over all tasks lists each task's files (so this file follows
# params.yaml's pipeline.tasks: `crucible dag write` after changing them). `dvc repro` reruns what changed.
"""


def dvc_yaml_text(
    specs: list[StageSpec],
    views: list | None = None,
    views_comment: str = "",
    extra_code: dict[str, tuple[str, ...]] | None = None,
    tasks=(),
) -> str:
    import yaml

    def dump(obj, indent: int) -> str:
        text = yaml.safe_dump(obj, sort_keys=False, width=110, default_flow_style=False)
        return "".join(" " * indent + line if line.strip() else line for line in text.splitlines(True))

    parts = [HEADER, "stages:\n"]
    for spec in specs:
        parts.append("".join(f"  # {line}\n" for line in _wrap(spec.comment, 100)))
        parts.append(dump({spec.name: dvc_stage(spec, (extra_code or {}).get(spec.name, ()), tasks)}, 2))
        parts.append("\n")
    if views:
        parts.append("".join(f"# {line}\n" for line in _wrap(views_comment, 100)) if views_comment else "")
        parts.append(dump({"plots": views}, 0))
    return "".join(parts).rstrip("\n") + "\n"


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


# ---------------------------------------------------------------------------------------------------
# the DAG of stage runs


def instances(specs: list[StageSpec], tasks: list[str]) -> list[tuple[StageSpec, str | None]]:
    """Every run of every stage, in declaration order: one per task for a per-task stage."""
    return [(s, t) for s in specs for t in (tasks if s.per_task else [None])]


def _overlaps(a: str, b: str) -> bool:
    """One path is the other or lies inside it."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def upstream(specs: list[StageSpec], tasks: list[str]) -> dict[str, set[str]]:
    """stage id -> the stage ids whose outputs it reads (a declared dependency that is, holds or lies
    inside another run's output). Raises if two runs write the same path or the graph has a cycle."""
    runs = instances(specs, tasks)
    writes = {s.sid(t): [expand(w, t) for w in s.written()] for s, t in runs}
    owner: dict[str, str] = {}
    for sid, paths in writes.items():
        for p in paths:
            if p in owner:
                raise ValueError(f"{p} is declared as an output of both {owner[p]} and {sid}")
            owner[p] = sid
    edges = {}
    for s, t in runs:
        sid = s.sid(t)
        edges[sid] = {
            other
            for d in expand_deps(s, t, tasks)
            for other, paths in writes.items()
            if other != sid and any(_overlaps(d, p) for p in paths)
        }
    _check_acyclic(edges)
    return edges


def _check_acyclic(edges: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        if state.get(node) == 1:
            raise ValueError(f"the stages' declarations form a cycle: {' -> '.join(path + [node])}")
        state[node] = 1
        for up in sorted(edges[node]):
            visit(up, path + [node])
        state[node] = 2

    for node in edges:
        visit(node, [])


def overlaps(edges: dict[str, set[str]]) -> dict[str, int]:
    """For each run, how many runs may go side by side with it (itself included): those that are
    neither upstream nor downstream of it. A property of the DAG alone, never of timing, so the
    cores a run gets (and with them its sums' rounding) are the same on every run of the flow."""
    ancestors: dict[str, set[str]] = {}

    def up(node: str) -> set[str]:
        if node not in ancestors:
            ancestors[node] = set(edges[node]).union(*(up(u) for u in edges[node])) if edges[node] else set()
        return ancestors[node]

    for node in edges:
        up(node)
    return {
        node: 1
        + sum(1 for other in edges if other != node and other not in ancestors[node] and node not in ancestors[other])
        for node in edges
    }
