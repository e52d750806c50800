"""One module per dvc.yaml stage; each holds only what that stage does and declares, once, what it
reads and writes (`SPEC`). This package lists them in the pipeline's order; dvc.yaml and the
flow's DAG both come from these declarations (tasks/runtime/declaration.py).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from types import ModuleType

from tasks.runtime.declaration import StageSpec, dvc_yaml_text

# the pipeline's order (dvc.yaml's, and the flow's where the DAG allows a choice)
NAMES = (
    "model",
    "ingest",
    "embed",
    "curate",
    "pseudolabel",
    "finetune",
    "merge",
    "quantize",
    "moe_build",
    "moe_quantize",
    "evaluate",
    "register",
)
# code files a stage runs that are not Python modules (found by no import)
EXTRA_CODE = {"evaluate": ("tasks/report/templates",)}


def module(name: str) -> ModuleType:
    """The stage's module, its SPEC naming it (so the declaration can find the code it imports)."""
    if name not in NAMES:
        raise KeyError(f"unknown stage {name!r}; valid: {', '.join(NAMES)}")
    mod = importlib.import_module(f"{__name__}.{name}")
    if mod.SPEC.module != mod.__name__:
        mod.SPEC = dataclasses.replace(mod.SPEC, module=mod.__name__)
    return mod


def spec(name: str) -> StageSpec:
    return module(name).SPEC


def specs() -> list[StageSpec]:
    return [spec(n) for n in NAMES]


def dvc_yaml(tasks) -> str:
    """dvc.yaml's text, from the declarations, for pipeline.tasks `tasks`."""
    from tasks.stages import evaluate

    extra = {
        k: tuple(p for p in v if (Path(__file__).resolve().parents[2] / p).exists()) for k, v in EXTRA_CODE.items()
    }
    return dvc_yaml_text(specs(), evaluate.VIEWS, evaluate.VIEWS_COMMENT, extra, list(tasks))


def project_dvc_yaml(root: Path | str) -> str:
    """dvc.yaml's text for the project at `root` (its params.yaml's tasks)."""
    from tasks.runtime.params import load_params

    return dvc_yaml(load_params(Path(root) / "params.yaml").pipeline.tasks)


def write_dvc_yaml(root: Path | str) -> bool:
    """Rewrite `root`/dvc.yaml when it differs from the declarations for its params' tasks; True if
    it was rewritten."""
    path = Path(root) / "dvc.yaml"
    text = project_dvc_yaml(root)
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def execute(name: str, task: str | None = None, root: Path | str = ".", **kwargs):
    """Run stage `name` (for `task`) through the stage contract (tasks/runtime/stage.py)."""
    from tasks.runtime.stage import execute as run_contract

    return run_contract(module(name), task, root, **kwargs)
