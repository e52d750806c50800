"""MLflow tracking: a local SQLite store by default, one parent run per pipeline run, one child
run per stage (per task where a stage fans out), and lineage tags on every run.

Defaults need no server: tracking URI `sqlite:///<project>/mlflow.db`, artifacts under
`<project>/mlartifacts` (set explicitly on the experiment, so no ./mlruns file store appears).
`MLFLOW_TRACKING_URI` points it at a server instead. The explicit MlflowClient is used rather than
the fluent API: stages run in threads of one process under Prefect, and the fluent API's active
run is per thread. SQLite dislikes concurrent writers, so writes from one process are serialised.

The store is checked before first use in a process (check_store): a server that does not answer,
or an unreadable or corrupt mlflow.db, is an error naming it (TrackingStoreError); a deleted store
of a workspace that registered before is a warning naming what was lost; a copied or moved
workspace gets its artifact locations rewritten to its own mlartifacts/. Every stage start ends
what killed runs left behind: RUNNING runs of dead processes (fail_orphaned_runs) and logged models
that no registered version uses (remove_orphaned_models).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tasks.runtime.paths import REGISTERED

WRITE_LOCK = threading.Lock()
PARENT_ENV = "CRUCIBLE_PARENT_RUN_ID"
DB_NAME = "mlflow.db"
ARTIFACTS = "mlartifacts"
FAILURE_TAG = "crucible.failure"  # why a run or a logged model was ended by the next start
SERVER_CHECK_S = 5.0  # seconds per attempt (two attempts) to reach a tracking server before a run starts


class TrackingStoreError(RuntimeError):
    """The tracking store cannot be used: a server that does not answer, an unreadable or corrupt
    mlflow.db. The message names the URI or the file and what to do."""


def say(message: str) -> None:
    """A line on stderr, as the stages report what they do beside their output (`crucible: ...`)."""
    import sys

    print(f"crucible: {message}", file=sys.stderr, flush=True)


def tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI, or the workspace's SQLite store `<root>/mlflow.db`; checked once per
    process and store (check_store): a server that does not answer or a corrupt database raises
    TrackingStoreError, a workspace copied or moved gets its artifact locations rewritten."""
    root = Path(root).resolve()
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / DB_NAME}"
    check_store(root, uri)
    return uri


_CHECKED: set = set()
_CHECK_LOCK = threading.Lock()


def check_store(root: Path, uri: str | None = None) -> None:
    """Check the tracking store before anything uses it (once per process, per store and file):

    - a server (http, https): it must answer within two tries of SERVER_CHECK_S seconds, else
      TrackingStoreError naming the URI (MLflow's own retries would take minutes: see
      tasks/runtime/env.py for the retry and timeout settings the stages run with);
    - an SQLite file: readable and intact (SQLite's quick_check), else TrackingStoreError naming
      the file and what to do;
    - the workspace's own mlflow.db: missing (or empty) where the workspace registered a model
      before: a warning naming what was lost; copied or moved from another folder (its artifact
      locations still point into the old folder's mlartifacts/): rewritten to this workspace's
      mlartifacts/, so the copy tracks, registers and serves from its own files."""
    root = Path(root).resolve()
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / DB_NAME}"
    own = uri == f"sqlite:///{root / DB_NAME}"
    db = Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None
    try:
        ident = db.stat().st_ino if db is not None and db.stat().st_size else None
    except OSError:
        ident = None
    key = (uri, ident)
    with _CHECK_LOCK:
        if key in _CHECKED:
            return
        if uri.startswith(("http://", "https://")):
            _check_server(uri)
        elif db is not None:
            if ident is None:
                if own:
                    _warn_lost_store(root, db)
            else:
                _check_database(db)
                if own:
                    relocate_artifacts(root, db)
        _CHECKED.add(key)


def _check_server(uri: str) -> None:
    import time
    import urllib.error
    import urllib.request

    reason = ""
    for attempt in range(2):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=SERVER_CHECK_S):
                return
        except urllib.error.HTTPError:
            return  # it answered (an error status is the server's to explain on real requests)
        except (OSError, ValueError) as exc:
            reason = str(getattr(exc, "reason", None) or exc)
        if attempt == 0:
            time.sleep(1.0)
    raise TrackingStoreError(
        f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer ({reason}); start it, fix "
        f"MLFLOW_TRACKING_URI, or unset it to track in the workspace's {DB_NAME}"
    )


def _check_database(db: Path) -> None:
    import sqlite3

    fix = (
        f"restore it from a backup, or move it aside (`mv {db} {db}.broken`) to start an empty store: the runs, "
        f"registered versions and aliases it held are then lost (the files under {ARTIFACTS}/ stay)"
    )
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        try:
            problems = [r[0] for r in con.execute("PRAGMA quick_check").fetchall() if r[0] != "ok"]
        finally:
            con.close()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            return  # a writer holds it right now: it is in use, not broken
        raise TrackingStoreError(
            f"{db}: the MLflow tracking store cannot be read ({exc}); check its permissions, or {fix}"
        ) from None
    except sqlite3.DatabaseError as exc:
        raise TrackingStoreError(f"{db}: the MLflow tracking store is corrupt or truncated ({exc}); {fix}") from None
    if problems:
        raise TrackingStoreError(f"{db}: the MLflow tracking store is damaged ({'; '.join(problems[:3])}); {fix}")


def _warn_lost_store(root: Path, db: Path) -> None:
    import json

    record = root / REGISTERED
    if not record.is_file():
        return
    try:
        data = json.loads(record.read_text())
        what = f"version {data['version']} of {data['name']!r}" + (
            f" (aliases: {', '.join(data['aliases'])})" if data.get("aliases") else ""
        )
    except (OSError, ValueError, KeyError, TypeError):
        what = "a model"
    say(
        f"warning: {db} is missing or empty, but this workspace registered {what} before ({record}): the registry "
        f"(its versions, aliases and gate history) and every run it held are lost; a new, empty store is created "
        f"and the next register starts again at version 1. Restore {db} from a backup to keep them"
    )


# the tables and columns of an MLflow SQL store that hold artifact locations
_LOCATIONS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


def relocate_artifacts(root: Path, db: Path | None = None) -> str | None:
    """If the workspace's mlflow.db records its artifacts under another folder's mlartifacts/ (the
    workspace was copied or moved), point every artifact location (experiments, runs, logged models,
    model versions) at this workspace's mlartifacts/ instead. Returns the old location, or None when
    nothing was rewritten. One transaction; a second caller finds nothing left to do."""
    import sqlite3

    root = Path(root).resolve()
    db = db or root / DB_NAME
    new = (root / ARTIFACTS).as_uri()

    def elsewhere() -> list[str]:  # the experiments' artifact roots that are another folder's mlartifacts/
        return sorted(
            {
                loc
                for (loc,) in con.execute("SELECT artifact_location FROM experiments")
                if isinstance(loc, str)
                and loc.startswith("file://")
                and loc.rstrip("/").endswith(f"/{ARTIFACTS}")
                and loc.rstrip("/") != new
            }
        )

    con = sqlite3.connect(str(db), timeout=60, isolation_level=None)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "experiments" not in tables or not elsewhere():  # the usual case: a read, no write lock taken
            return None
        con.execute("BEGIN IMMEDIATE")
        olds = elsewhere()  # again, under the write lock: another process may have rewritten them
        if not olds:
            con.execute("ROLLBACK")
            return None
        for old in olds:
            old = old.rstrip("/")
            for table, column in _LOCATIONS:
                if table in tables:  # exact prefix match (LIKE would ignore case)
                    con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                        f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                        (new, len(old) + 1, old, len(old) + 1, old + "/"),
                    )
        con.execute("COMMIT")
    finally:
        con.close()
    from urllib.parse import unquote, urlparse

    before = ", ".join(str(Path(unquote(urlparse(o).path)).parent) for o in olds)
    say(
        f"{root}: this workspace was copied or moved from {before}: its tracking store now keeps its artifacts "
        f"in {root / ARTIFACTS} (it no longer reads or writes the old folder's)"
    )
    return olds[0]


def _client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(root))


def ensure_experiment(root: Path, name: str) -> str:
    """The experiment's id, creating it (artifact location inside the project) if needed.
    Call before fanning out: concurrent creation races on SQLite."""
    client = _client(root)
    with WRITE_LOCK:
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            location = (Path(root).resolve() / ARTIFACTS).as_uri()
        return client.create_experiment(name, artifact_location=location)


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def git_dirty(root: Path) -> bool | None:
    """Whether the git work tree at `root` has changes to tracked files (None: not a git repository)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def experiment_name() -> str | None:
    """The DVC experiment this process runs in: `dvc exp run` sets DVC_EXP_NAME for its stages
    (a name it makes up when none is given); None outside an experiment."""
    import os

    return os.environ.get("DVC_EXP_NAME") or None


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
        with WRITE_LOCK:
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])

    def log_metrics(self, metrics: dict, step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        flat = {
            k: float(v) for k, v in _flatten(metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        with WRITE_LOCK:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in flat.items()])

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        with WRITE_LOCK:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        with WRITE_LOCK:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, folder: Path | str, artifact_path: str | None = None) -> None:
        with WRITE_LOCK:
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
def stage_run(
    root: Path, experiment: str, stage: str, task: str | None = None, parent_run_id: str | None = None
) -> Iterator[StageRun]:
    """A child run of `parent_run_id` (or of $CRUCIBLE_PARENT_RUN_ID; a top-level run if neither),
    named `stage` or `stage@task`, marked FAILED if the body raises."""
    client = _client(root)
    experiment_id = ensure_experiment(root, experiment)
    parent = parent_run_id or os.environ.get(PARENT_ENV)
    name = stage if task is None else f"{stage}@{task}"
    from tasks.runtime.scratch import owner_tag

    fail_orphaned_runs(root, experiment_id)
    remove_orphaned_models(root, experiment_id)
    tags = {
        "crucible.stage": stage,
        "crucible.git_commit": git_commit(root),
        "mlflow.runName": name,
        "crucible.owner": owner_tag(),
    }
    if task is not None:
        tags["crucible.task"] = task
    if parent:
        tags["mlflow.parentRunId"] = parent
    with WRITE_LOCK:
        run = client.create_run(experiment_id, tags=tags, run_name=name)
    handle = StageRun(client, run.info.run_id, parent)
    try:
        yield handle
    except BaseException:
        with WRITE_LOCK:
            client.set_terminated(run.info.run_id, status="FAILED")
        raise
    with WRITE_LOCK:
        client.set_terminated(run.info.run_id, status="FINISHED")


def fail_orphaned_runs(root: Path, experiment_id: str) -> list[str]:
    """Mark FAILED the runs still RUNNING whose process (tag crucible.owner, `<pid>@<host>`) is gone
    from this host: a stage killed with SIGKILL could not end its own run. Returns their ids."""
    from tasks.runtime.scratch import tag_alive

    client = _client(root)
    with WRITE_LOCK:
        runs = client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=500)
        failed = []
        for run in runs:
            if tag_alive(run.data.tags.get("crucible.owner", "")) is False:
                client.set_tag(run.info.run_id, FAILURE_TAG, "interrupted: its process is gone")
                client.set_terminated(run.info.run_id, status="FAILED")
                failed.append(run.info.run_id)
    return failed


def remove_orphaned_models(root: Path, experiment_id: str) -> list[str]:
    """Remove the logged models that a run left half-made: a model whose run ended FAILED or KILLED
    (a register killed while it logged the model, or before it registered it; fail_orphaned_runs
    has marked a killed run FAILED by now) and that no registered version uses. Each is tagged
    crucible.failure (why), marked FAILED, deleted from the store, and its files under this
    workspace's mlartifacts/ removed. Returns their ids."""
    import shutil
    from urllib.parse import unquote, urlparse

    from mlflow.entities import LoggedModelStatus
    from mlflow.exceptions import MlflowException

    client = _client(root)
    removed = []
    with WRITE_LOCK:
        models = [
            m
            for m in client.search_logged_models([experiment_id], max_results=1000)
            if FAILURE_TAG not in (m.tags or {})
        ]
        used = None
        for m in models:
            try:
                run = client.get_run(m.source_run_id) if m.source_run_id else None
            except MlflowException:
                run = None
            if run is None or run.info.status not in ("FAILED", "KILLED"):
                continue
            if used is None:  # every model a registered version points at
                used = set()
                for v in client.search_model_versions(max_results=10000):
                    used.update(x for x in (getattr(v, "model_id", None), v.source) if x)
            if m.model_id in used or m.artifact_location in used:
                continue
            client.set_logged_model_tags(
                m.model_id,
                {
                    FAILURE_TAG: (
                        f"orphaned: its run {run.info.run_name or ''} ({run.info.run_id}) ended "
                        f"{run.info.status} before the model was registered; deleted at the next start"
                    )
                },
            )
            if m.status != LoggedModelStatus.FAILED:
                client.finalize_logged_model(m.model_id, LoggedModelStatus.FAILED)
            client.delete_logged_model(m.model_id)
            removed.append(m.model_id)
            location = urlparse(m.artifact_location or "")
            folder = Path(unquote(location.path)).parent if location.scheme == "file" else None
            mine = (Path(root).resolve() / ARTIFACTS).as_posix() + "/"
            if folder is not None and folder.as_posix().startswith(mine) and folder.name == m.model_id:
                shutil.rmtree(folder, ignore_errors=True)
    for model_id in removed:
        say(f"removed the logged model {model_id}: its run ended before registering it (a killed or failed register)")
    return removed


def start_parent_run(root: Path, experiment: str, name: str, tags: dict) -> str:
    from tasks.runtime.scratch import owner_tag

    client = _client(root)
    experiment_id = ensure_experiment(root, experiment)
    fail_orphaned_runs(root, experiment_id)
    remove_orphaned_models(root, experiment_id)
    tags = {"crucible.git_commit": git_commit(root), "crucible.owner": owner_tag(), **tags}
    with WRITE_LOCK:
        return client.create_run(experiment_id, tags=tags, run_name=name).info.run_id


def end_run(root: Path, run_id: str, status: str) -> None:
    with WRITE_LOCK:
        _client(root).set_terminated(run_id, status=status)
