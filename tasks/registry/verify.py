"""The register stage's last check before a version exists: the pyfunc it is about to log is the
bytes its producer wrote, and it loads and predicts in a fresh process, as serving will load it.

    verify_pyfunc(root, folder, source, stage, example)   # raises; then nothing is registered

1. The weight and head files packed into the pyfunc (`<folder>/artifacts/model_dir/`) are checked
   against what their producer recorded for `source`'s files (tasks/runtime/lockcheck.py: dvc.lock's
   md5 of the stage's output, or that stage's record of its last run), as every stage's inputs are
   before it runs. With no dvc.lock entry for the producer (no dvc.lock yet, a workspace that is
   not a DVC project) there is nothing to compare with; step 2 still runs, and the version's
   lineage tag `crucible.lineage.dvc_lock` says the lock was missing.
2. A new interpreter loads the saved folder (once per content: a folder whose files, example rows,
   interpreter and MLflow version equal one that passed before in this workspace is not loaded
   again; `.crucible/verified/`) with `mlflow.pyfunc.load_model` (the model's own code
   and weights, no state of this process) and predicts `example` (a text of each task): every row
   must get one of its task's classes and finite probabilities that sum to 1.

A failure raises ValueError (`crucible stage register` exits 2) with one line naming the source file
where the error names one, and the stage that rebuilds it. The register stage calls this inside
log_pyfunc's save step, before any version is created or alias moved, so a refused model leaves
the registry as it was (its logged model is marked FAILED).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from tasks.runtime import lockcheck
from tasks.runtime.io import md5_file, rebuild_hint

PACKED = ("model.safetensors", "heads.safetensors")  # copied from the source folder (pyfunc.stage_multitask_folder)
TIMEOUT_S = 900.0
_MARK = "crucible-verify: "  # the child's error line on stderr
# one empty file per content_key that loaded and predicted in a fresh process (a version registered
# again from the same bytes, or a second registry, is not loaded again)
VERIFIED = Path(".crucible") / "verified"


def packed_dir(folder: Path) -> Path:
    """Where mlflow.pyfunc.save_model put the model's files (its `model_dir` artifact)."""
    return Path(folder) / "artifacts" / "model_dir"


def verify_pyfunc(root: Path, folder: Path, source: Path, stage: str, example: pd.DataFrame) -> Path:
    """Check the pyfunc saved in `folder` (made from the stage folder `source`, written by `stage`);
    returns `folder`. Raises ValueError naming the file and the stage to rerun."""
    root, folder, source = Path(root).resolve(), Path(folder), Path(source).resolve()
    packed = packed_dir(folder)
    rel = source.relative_to(root).as_posix()
    lockcheck.check(root, "register", {f"{rel}/{n}": md5_file(packed / n) for n in PACKED})
    mark = Path(root) / VERIFIED / content_key(folder, example)
    if mark.is_file():  # these very bytes, code and example loaded and predicted before: compute once
        return folder
    error = load_in_fresh_process(folder, example)
    if error is None:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(str(folder) + "\n")
        return folder
    from tasks.registry.pyfunc import REBUILD

    error = (
        error.replace(f"; {REBUILD}", "").replace(str(packed.resolve()), str(source)).replace(str(packed), str(source))
    )
    where = "" if str(source) in error else f"{source}: "
    raise ValueError(
        f"{where}{error}; the model register was about to log does not load and predict in a fresh process as "
        f"serving would, so nothing was registered: {rebuild_hint(stage)}"
    )


def content_key(folder: Path, example: pd.DataFrame) -> str:
    """md5 of what decides whether the saved pyfunc loads and predicts: every file of `folder` (its
    weights, code and requirements) but MLmodel, which differs on every save by its id and time
    alone, with MLmodel's other lines; the example rows; this interpreter and its MLflow."""
    import hashlib

    import mlflow

    h = hashlib.md5()
    folder = Path(folder)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == "MLmodel":
            volatile = ("model_uuid:", "utc_time_created:", "model_id:", "run_id:", "artifact_path:")
            body = "\n".join(line for line in path.read_text().splitlines() if not line.strip().startswith(volatile))
            h.update(f"{rel}\0{hashlib.md5(body.encode()).hexdigest()}\0".encode())
        else:
            h.update(f"{rel}\0{md5_file(path)}\0".encode())
    h.update(json.dumps(example[["text", "task"]].to_dict(orient="list"), sort_keys=True).encode())
    h.update(f"{sys.executable}\0{mlflow.__version__}".encode())
    return h.hexdigest()


def load_in_fresh_process(folder: Path, example: pd.DataFrame, timeout: float = TIMEOUT_S) -> str | None:
    """None if a new interpreter loads the pyfunc in `folder` and predicts `example` well; else why not."""
    rows = example[["text", "task"]].to_dict(orient="list")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tasks.registry.verify", str(Path(folder).resolve())],
            input=json.dumps(rows),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path(__file__).resolve().parents[2],  # the project, for `-m tasks.registry.verify`
            env={**os.environ, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"},
        )
    except subprocess.TimeoutExpired:
        return f"loading the model and predicting {len(example)} rows took over {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    said = [line[len(_MARK) :] for line in proc.stderr.splitlines() if line.startswith(_MARK)]
    if said:
        return said[-1]
    tail = " ".join(proc.stderr.strip().splitlines()[-1:]) or f"exit status {proc.returncode}"
    return f"the loading process failed ({tail})"


def _predicts(model, rows: pd.DataFrame) -> None:
    """Raise unless `model` answers `rows` as the served model must."""
    import math

    out = model.predict(rows)
    if len(out) != len(rows):
        raise ValueError(f"predicted {len(out)} rows for {len(rows)}")
    classes = model.unwrap_python_model().classes
    for i, (task, label) in enumerate(zip(rows["task"], out["label"])):
        if label not in classes[task]:
            raise ValueError(f"row {i} (task {task!r}): label {label!r} is not one of {classes[task]}")
        proba = [out[f"proba_{c}"].iloc[i] for c in classes[task]]
        if not all(isinstance(p, float) and math.isfinite(p) for p in proba) or abs(sum(proba) - 1) > 1e-6:
            raise ValueError(f"row {i} (task {task!r}): probabilities {proba} are not finite or do not sum to 1")


def main(argv: list[str]) -> int:
    """The fresh process: load the pyfunc folder argv[0], predict the rows given as JSON on stdin."""
    try:
        import mlflow.pyfunc

        rows = pd.DataFrame(json.loads(sys.stdin.read()))
        _predicts(mlflow.pyfunc.load_model(argv[0]), rows)
    except Exception as exc:  # the parent names the file and the fix
        print(_MARK + " ".join(str(exc).split()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
