"""The tracking store fails fast and by name (tasks/runtime/tracking.py check_store): a server that
does not answer is reported within 30 s naming its URI; a truncated or corrupt mlflow.db is an
error naming the file and what to do (exit 2, no traceback); a deleted store of a workspace that
registered before is a warning naming what was lost; a copied workspace's artifact locations are
rewritten to its own mlartifacts/; the stages run with short MLflow HTTP retries, overridable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.registry.serving import free_port

BIN = Path(sys.executable).parent


@pytest.fixture
def ws(tmp_path, project_root) -> Path:
    from tasks.runtime.workspace import make_workspace

    return make_workspace(project_root, tmp_path / "ws", "tiny")


def crucible(root: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "crucible"), *args, "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PREFECT_HOME": str(root / ".prefect"), **(env or {})},
    )


def test_an_unreachable_tracking_server_is_named_within_30_seconds(ws):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    out = crucible(ws, "stage", "evaluate", env={"MLFLOW_TRACKING_URI": uri})
    took = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-3000:]
    assert took < 30, f"took {took:.0f} s"
    assert out.stderr.startswith(
        f"error: stage evaluate: the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer"
    ), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1


def test_the_flow_says_so_before_it_starts(ws, capsys, monkeypatch):
    from flows.cli import build_parser

    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    args = build_parser().parse_args(["run", "--root", str(ws)])
    assert args.func(args) == 2
    assert f"error: the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer" in capsys.readouterr().err


def test_the_stages_run_with_short_mlflow_http_retries_that_the_user_can_override(monkeypatch, tmp_path):
    from tasks.runtime.env import apply_defaults

    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    apply_defaults(tmp_path)
    retries, factor = (
        int(os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]),
        int(os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]),
    )
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "60"  # the user's own setting wins
    # a request to a dead server: retries + 1 tries, backoff factor * 2^(k-1) s between them (urllib3)
    waits = sum(factor * 2 ** (k - 1) for k in range(1, retries))
    assert (retries + 1) * 8 + waits < 30


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_corrupt_store_is_named_with_what_to_do(ws, damage):
    from tasks.runtime.tracking import ensure_experiment

    ensure_experiment(ws, "crucible")  # a real store first
    db = ws / "mlflow.db"
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a database " * 500)
    out = crucible(ws, "stage", "evaluate")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(f"error: stage evaluate: {db}: the MLflow tracking store is corrupt or truncated"), (
        out.stderr
    )
    assert f"mv {db} {db}.broken" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1
    # every command that opens the store says the same
    out = crucible(ws, "predict", "--task", "bbc", "some text")
    assert out.returncode == 2 and f"error: {db}: the MLflow tracking store is corrupt" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_deleted_store_of_a_workspace_that_registered_is_a_warning_naming_what_was_lost(tmp_path, capsys):
    from tasks.runtime.tracking import tracking_uri

    record = tmp_path / "metrics" / "registered.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"name": "crucible-classifier", "version": 3, "aliases": ["champion"]}))
    tracking_uri(tmp_path)
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'mlflow.db'} is missing or empty" in err
    assert "registered version 3 of 'crucible-classifier' (aliases: champion) before" in err
    assert "the next register starts again at version 1" in err
    other = tmp_path / "elsewhere"
    other.mkdir()
    tracking_uri(other)  # a workspace that never registered: nothing to say
    assert "warning" not in capsys.readouterr().err


def test_a_copied_workspace_tracks_in_its_own_artifacts(tmp_path, capsys):
    """A store whose experiment, run, logged model and model version live in a/mlartifacts, copied
    to b (as `cp -a` would) and a deleted: opened in b, every location points into b/mlartifacts,
    and the version's files are read from there."""
    from mlflow.tracking import MlflowClient

    from tasks.runtime.tracking import ensure_experiment, relocate_artifacts, tracking_uri

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    client = MlflowClient(tracking_uri=tracking_uri(a))
    exp = ensure_experiment(a, "crucible")
    run = client.create_run(exp).info.run_id
    src = tmp_path / "src"
    src.mkdir()
    (src / "note.txt").write_text("hello")
    client.log_artifact(run, str(src / "note.txt"))
    logged = client.create_logged_model(experiment_id=exp, name="model", source_run_id=run)
    client.log_model_artifacts(logged.model_id, str(src))
    client.create_registered_model("m")
    client.create_model_version("m", source=logged.artifact_location, run_id=run, model_id=logged.model_id)
    shutil.copytree(a, b, symlinks=True)
    shutil.rmtree(a)
    capsys.readouterr()

    client = MlflowClient(tracking_uri=tracking_uri(b), registry_uri=tracking_uri(b))
    assert f"this workspace was copied or moved from {a}" in capsys.readouterr().err
    mine = (b / "mlartifacts").as_uri()
    assert client.get_experiment(exp).artifact_location == mine
    assert client.get_run(run).info.artifact_uri.startswith(mine + "/")
    assert client.get_logged_model(logged.model_id).artifact_location.startswith(mine + "/")
    mv = client.get_model_version("m", "1")
    assert mv.source.startswith(mine + "/") and client.get_model_version_download_uri("m", "1").startswith(mine + "/")
    assert [f.path for f in client.list_artifacts(run)] == ["note.txt"]
    import mlflow.artifacts

    got = mlflow.artifacts.download_artifacts(
        artifact_uri=client.get_model_version_download_uri("m", "1"),
        dst_path=str(tmp_path / "dl"),
        tracking_uri=tracking_uri(b),
    )
    assert (Path(got) / "note.txt").read_text() == "hello"
    # new runs write into b too, and a second look rewrites nothing
    assert client.create_run(exp).info.artifact_uri.startswith(mine + "/")
    assert relocate_artifacts(b) is None
