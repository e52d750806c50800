"""Faults leave nothing behind: temporary files and scratch folders carry their owner and are swept
only when the owner is gone; a killed stage's MLflow run is marked FAILED (by the stage itself on
SIGTERM, at the next start after SIGKILL); outputs get the usual file mode."""

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.runtime.io import AtomicOutputs
from tasks.runtime.scratch import SCRATCH, owner_tag, scratch, sweep, sweep_files, tag_alive


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def host() -> str:
    return owner_tag().split("@", 1)[1]


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_atomic_outputs_sweep_only_dead_owners_files(tmp_path, sleeper):
    dest = tmp_path / "out" / "model.safetensors"
    dest.parent.mkdir()
    live = dest.parent / f".model.safetensors.{sleeper}@{host()}.abc123.tmp"
    dead = dest.parent / f".model.safetensors.{dead_pid()}@{host()}.def456.tmp"
    other_host = dest.parent / ".model.safetensors.123@elsewhere.ghi789.tmp"
    legacy_old, legacy_new = dest.parent / ".model.safetensors.k3j4h5g6.tmp", dest.parent / ".pool.parquet.zz11yy22.tmp"
    for f in (live, dead, other_host, legacy_old, legacy_new):
        f.write_bytes(b"partial")
    os.utime(legacy_old, (time.time() - 7200, time.time() - 7200))
    with AtomicOutputs() as out:
        out.bytes(b"weights", dest)
    assert dest.read_bytes() == b"weights"
    assert live.exists() and other_host.exists() and legacy_new.exists()  # another run may still write them
    assert not dead.exists() and not legacy_old.exists()
    assert not [p for p in dest.parent.glob(f".*{owner_tag()}*.tmp")]  # our own temporary file was renamed


def test_outputs_get_the_usual_mode_not_mkstemps_0600(tmp_path):
    old = os.umask(0o022)
    try:
        with AtomicOutputs() as out:
            out.json({"a": 1}, tmp_path / "m.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.json").stat().st_mode) == 0o644


def test_scratch_is_in_the_workspace_and_removed_on_exit_and_on_error(tmp_path):
    with scratch(tmp_path, "merge") as folder:
        assert folder.parent == tmp_path / SCRATCH and owner_tag() in folder.name
        (folder / "theta0.safetensors").write_bytes(b"x" * 100)
    assert not folder.exists()
    with pytest.raises(RuntimeError):
        with scratch(tmp_path, "merge") as folder:
            raise RuntimeError("boom")
    assert not folder.exists()


def test_a_killed_runs_scratch_is_swept_at_the_next_start_a_live_ones_is_not(tmp_path, sleeper):
    base = tmp_path / SCRATCH
    base.mkdir(parents=True)
    dead = base / f"merge-{dead_pid()}@{host()}-x1y2z3"
    live = base / f"merge-{sleeper}@{host()}-a1b2c3"
    for d in (dead, live):
        d.mkdir()
        (d / "theta0.safetensors").write_bytes(b"x")
    (tmp_path / "data").mkdir()
    stale_tmp = tmp_path / "data" / f".curated.parquet.{dead_pid()}@{host()}.q1w2e3.tmp"
    stale_tmp.write_bytes(b"partial")
    removed = sweep(tmp_path, ["data"])
    assert set(removed) == {dead, stale_tmp}
    assert live.exists() and not dead.exists()
    assert sweep_files(tmp_path / "data") == []


def test_owner_tags(sleeper):
    assert tag_alive(owner_tag()) is True
    assert tag_alive(f"{sleeper}@{host()}") is True
    assert tag_alive(f"{dead_pid()}@{host()}") is False
    assert tag_alive("1@another_host") is None and tag_alive("") is None


def test_orphaned_mlflow_runs_are_marked_failed_live_ones_are_not(tmp_path, sleeper):
    from mlflow.tracking import MlflowClient

    from tasks.runtime.tracking import ensure_experiment, fail_orphaned_runs, tracking_uri

    exp = ensure_experiment(tmp_path, "crucible")
    client = MlflowClient(tracking_uri=tracking_uri(tmp_path))
    orphan = client.create_run(exp, tags={"crucible.owner": f"{dead_pid()}@{host()}"}).info.run_id
    live = client.create_run(exp, tags={"crucible.owner": f"{sleeper}@{host()}"}).info.run_id
    foreign = client.create_run(exp, tags={"crucible.owner": "5@another_host"}).info.run_id
    assert fail_orphaned_runs(tmp_path, exp) == [orphan]
    assert client.get_run(orphan).info.status == "FAILED"
    assert client.get_run(orphan).data.tags["crucible.failure"].startswith("interrupted")
    assert client.get_run(live).info.status == "RUNNING" and client.get_run(foreign).info.status == "RUNNING"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=pytest.mark.long)])
def test_a_killed_stage_leaves_no_running_run_and_no_temporary_files(tiny_project, sig):
    """Kill `crucible stage embed` mid-run: SIGTERM unwinds (run FAILED at once); after SIGKILL the
    next stage start marks it FAILED. Either way no temporary file or scratch folder survives the
    next start, and the stage's earlier outputs are untouched."""
    from mlflow.tracking import MlflowClient

    from tasks.runtime.tracking import tracking_uri

    root = tiny_project
    crucible = str(Path(sys.executable).with_name("crucible"))
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect")}
    subprocess.run([crucible, "stage", "ingest", "--task", "bbc"], cwd=root, env=env, check=True, capture_output=True)
    proc = subprocess.Popen(
        [crucible, "stage", "embed", "--task", "bbc"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = MlflowClient(tracking_uri=tracking_uri(root))
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the stage's run exists, then kill it mid-work
        exp = client.get_experiment_by_name("crucible")
        runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'embed@bbc'") if exp else []
        if runs:
            break
        time.sleep(0.2)
    assert runs, "the embed stage never started its MLflow run"
    time.sleep(1.0)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    run = client.get_run(runs[0].info.run_id)
    if sig == signal.SIGTERM:
        assert proc.returncode != 0 and run.info.status == "FAILED", proc.stderr.read()[-2000:]
    else:
        assert run.info.status == "RUNNING"  # nobody could end it ...
        subprocess.run(
            [crucible, "stage", "ingest", "--task", "rotten"], cwd=root, env=env, check=True, capture_output=True
        )
        assert client.get_run(run.info.run_id).info.status == "FAILED"  # ... until the next start
    assert not (root / "data" / "bbc" / "embeddings.safetensors").exists()
    assert not list((root / "data").rglob(".*.tmp")) or sig == signal.SIGKILL
    sweep(root, ["data/bbc"])
    assert not list((root / "data").rglob(".*.tmp"))


def test_a_logged_model_whose_run_died_is_removed_at_the_next_start(tmp_path, sleeper):
    """A register killed after logging its model (READY, files written) but before registering it
    leaves a logged model nothing uses: the next stage start marks its run FAILED, then tags the
    model (crucible.failure), marks it FAILED, deletes it and its files. A model a version uses, or
    one of a live run, is kept."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.tracking import MlflowClient

    from tasks.runtime.tracking import stage_run, tracking_uri

    exp_name = "crucible"
    with stage_run(tmp_path, exp_name, "ingest", "bbc"):
        pass  # creates the experiment in the workspace
    client = MlflowClient(tracking_uri=tracking_uri(tmp_path), registry_uri=tracking_uri(tmp_path))
    exp = client.get_experiment_by_name(exp_name).experiment_id
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights")

    def logged(owner: str, register: bool = False):
        run = client.create_run(exp, tags={"crucible.owner": owner}, run_name="register").info.run_id
        model = client.create_logged_model(experiment_id=exp, name="model", source_run_id=run)
        client.log_model_artifacts(model.model_id, str(src))
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        if register:
            client.create_registered_model("m") if not client.search_registered_models() else None
            client.create_model_version("m", source=model.artifact_location, run_id=run, model_id=model.model_id)
        return run, model

    dead = f"{dead_pid()}@{host()}"
    run, orphan = logged(dead)
    folder = Path(orphan.artifact_location.removeprefix("file://")).parent
    assert (folder / "artifacts" / "model.bin").is_file()
    kept_run, kept = logged(dead, register=True)  # registered, then killed: the version needs it
    _, live = logged(f"{sleeper}@{host()}")  # still being logged by a live process
    with stage_run(tmp_path, exp_name, "register"):  # the next start
        pass
    assert client.get_run(run).info.status == "FAILED"
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="not found"):  # deleted from the store ...
        client.get_logged_model(orphan.model_id)
    assert orphan.model_id not in [m.model_id for m in client.search_logged_models([exp])]
    assert not folder.exists()  # ... with its files
    import sqlite3

    with sqlite3.connect(tmp_path / "mlflow.db") as con:  # and the store's row says why
        status, stage = con.execute(
            "SELECT status, lifecycle_stage FROM logged_models WHERE model_id = ?", (orphan.model_id,)
        ).fetchone()
        why = con.execute(
            "SELECT tag_value FROM logged_model_tags WHERE model_id = ? AND tag_key = 'crucible.failure'",
            (orphan.model_id,),
        ).fetchone()[0]
    assert status == LoggedModelStatus.FAILED.to_int() and stage == "deleted"
    assert why.startswith(f"orphaned: its run register ({run}) ended FAILED before the model was registered")
    assert client.get_logged_model(kept.model_id).status == LoggedModelStatus.READY
    assert client.get_logged_model(live.model_id).status == LoggedModelStatus.READY
    assert Path(kept.artifact_location.removeprefix("file://"), "model.bin").is_file()
