"""MLflow tracking: a local SQLite store by default, one parent run per pipeline run, one child
run per stage (per task where a stage fans out), and lineage tags on every run.

Defaults need no server: tracking URI `sqlite:///<project>/mlflow.db`, artifacts under
`<project>/mlartifacts` (set explicitly on the experiment, so no ./mlruns file store appears).
`MLFLOW_TRACKING_URI` points it at a server instead. The explicit MlflowClient is used rather than
the fluent API: stages run in threads of one process under Prefect, and the fluent API's active
run is per thread. SQLite dislikes concurrent writers, so writes from one process are serialised.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_WRITE_LOCK = threading.Lock()
PARENT_ENV = "CRUCIBLE_PARENT_RUN_ID"


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def _client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(root))


def ensure_experiment(root: Path, name: str) -> str:
    """The experiment's id, creating it (artifact location inside the project) if needed.
    Call before fanning out: concurrent creation races on SQLite."""
    client = _client(root)
    with _WRITE_LOCK:
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            location = (root / "mlartifacts").resolve().as_uri()
        return client.create_experiment(name, artifact_location=location)


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


class StageRun:
    """Logging handle of one stage run; every call is serialised through the process-wide lock."""

    def __init__(self, client, run_id: str, parent_run_id: str | None = None):
        self.client, self.run_id, self.parent_run_id = client, run_id, parent_run_id

    def parent(self) -> "StageRun | None":
        """A handle on the pipeline's parent run (None when the stage runs on its own, e.g. under dvc repro)."""
        return StageRun(self.client, self.parent_run_id) if self.parent_run_id else None

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        flat = _flatten(params)
        with _WRITE_LOCK:
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])

    def log_metrics(self, metrics: dict, step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        flat = {k: float(v) for k, v in _flatten(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        with _WRITE_LOCK:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in flat.items()])

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        with _WRITE_LOCK:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        with _WRITE_LOCK:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, folder: Path | str, artifact_path: str | None = None) -> None:
        with _WRITE_LOCK:
            self.client.log_artifacts(self.run_id, str(folder), artifact_path)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


@contextmanager
def stage_run(root: Path, experiment: str, stage: str, task: str | None = None,
              parent_run_id: str | None = None) -> Iterator[StageRun]:
    """A child run of `parent_run_id` (or of $CRUCIBLE_PARENT_RUN_ID; a top-level run if neither),
    named `stage` or `stage@task`, marked FAILED if the body raises."""
    client = _client(root)
    experiment_id = ensure_experiment(root, experiment)
    parent = parent_run_id or os.environ.get(PARENT_ENV)
    name = stage if task is None else f"{stage}@{task}"
    from tasks.runtime.scratch import owner_tag

    fail_orphaned_runs(root, experiment_id)
    tags = {"crucible.stage": stage, "crucible.git_commit": git_commit(root), "mlflow.runName": name,
            "crucible.owner": owner_tag()}
    if task is not None:
        tags["crucible.task"] = task
    if parent:
        tags["mlflow.parentRunId"] = parent
    with _WRITE_LOCK:
        run = client.create_run(experiment_id, tags=tags, run_name=name)
    handle = StageRun(client, run.info.run_id, parent)
    try:
        yield handle
    except BaseException:
        with _WRITE_LOCK:
            client.set_terminated(run.info.run_id, status="FAILED")
        raise
    with _WRITE_LOCK:
        client.set_terminated(run.info.run_id, status="FINISHED")


def fail_orphaned_runs(root: Path, experiment_id: str) -> list[str]:
    """Mark FAILED the runs still RUNNING whose process (tag crucible.owner, `<pid>@<host>`) is gone
    from this host: a stage killed with SIGKILL could not end its own run. Returns their ids."""
    from tasks.runtime.scratch import tag_alive

    client = _client(root)
    with _WRITE_LOCK:
        runs = client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=500)
        failed = []
        for run in runs:
            if tag_alive(run.data.tags.get("crucible.owner", "")) is False:
                client.set_tag(run.info.run_id, "crucible.failure", "interrupted: its process is gone")
                client.set_terminated(run.info.run_id, status="FAILED")
                failed.append(run.info.run_id)
    return failed


def start_parent_run(root: Path, experiment: str, name: str, tags: dict) -> str:
    from tasks.runtime.scratch import owner_tag

    client = _client(root)
    experiment_id = ensure_experiment(root, experiment)
    fail_orphaned_runs(root, experiment_id)
    tags = {"crucible.git_commit": git_commit(root), "crucible.owner": owner_tag(), **tags}
    with _WRITE_LOCK:
        return client.create_run(experiment_id, tags=tags, run_name=name).info.run_id


def end_run(root: Path, run_id: str, status: str) -> None:
    with _WRITE_LOCK:
        _client(root).set_terminated(run_id, status=status)
