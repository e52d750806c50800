"""A scratch copy of the project with a profile's params: `crucible run --profile tiny` runs there.

The copy holds what DVC needs to see (dvc.yaml, the rendered params.yaml, the stage code it lists
as deps, inputs/) in its own git + DVC repository, so a small run never touches the main
project's data, dvc.lock or tracking store. Re-creating it refreshes code and params and keeps
its data and DVC state, so `dvc repro` there reruns only what changed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tasks.runtime.dvc_plots import TEMPLATE, use_template
from tasks.runtime.params import render_params, validate_params

# dvc.yaml as the project has it: `crucible run` rewrites it for the profile's tasks where they differ
PROJECT_FILES = ("dvc.yaml", ".dvcignore", "prefect.yaml")
PROJECT_DIRS = ("crucible", "tasks", "flows", "inputs")


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed in {cwd}:\n{proc.stderr.strip()}")


def make_workspace(
    source: Path | str, dest: Path | str, profile: str | None = None, overrides: dict | None = None
) -> Path:
    """Create or refresh the workspace `dest` from project `source`; returns `dest`."""
    from tasks.runtime.params import deep_merge

    source, dest = Path(source).resolve(), Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    data = render_params(source / "params.yaml", profile)
    if overrides:
        data = deep_merge(data, overrides)
    validate_params(data, f"{source / 'params.yaml'} (+ profile {profile})")
    for name in PROJECT_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    for name in PROJECT_DIRS:
        if (source / name).is_dir():
            shutil.rmtree(dest / name, ignore_errors=True)
            shutil.copytree(source / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    text = yaml.safe_dump(data, sort_keys=False)
    if not (dest / "params.yaml").exists() or (dest / "params.yaml").read_text() != text:
        (dest / "params.yaml").write_text(text)

    if not (dest / ".git").exists():
        _run(["git", "init", "-q"], dest)
        (dest / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/.prefect/\n/.crucible/\n/dvc_plots/\n")
    if not (dest / ".dvc").exists():
        dvc = Path(sys.executable).with_name("dvc")
        _run([str(dvc) if dvc.exists() else "dvc", "init", "-q"], dest)
        _run([str(dvc) if dvc.exists() else "dvc", "config", "core.analytics", "false"], dest)
    if (source / ".dvc" / "plots").is_dir():  # the plot templates that dvc.yaml's views name
        shutil.copytree(source / ".dvc" / "plots", dest / ".dvc" / "plots", dirs_exist_ok=True)
    if (dest / ".dvc" / TEMPLATE).is_file():  # the page of `dvc plots show` with vega inlined (dvc_plots.py)
        use_template(dest / ".dvc")
    return dest
