"""The workspace lock (tasks/runtime/lock.py): one run per workspace; a second waits, then fails naming the
holder; a killed holder's lock is taken over; a flow's stages run under its lock; a stage run by
`dvc repro` does not wait on a flow (that would deadlock on DVC's lock)."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tasks.runtime.lock import LOCK_FILE, WorkspaceLock, WorkspaceLocked, dvc_holder, holder


def _hold_in_child(root: Path, kind: str = "flow", path: str | None = None) -> subprocess.Popen:
    """A child process that takes the workspace lock (or flocks `path`) and sleeps until killed."""
    if path:
        code = f"""
            import fcntl, os, time
            os.makedirs(os.path.dirname({path!r}), exist_ok=True)
            f = open({path!r}, "w"); fcntl.flock(f, fcntl.LOCK_EX); f.write(" %d\\n" % os.getpid()); f.flush()
            print("held", flush=True); time.sleep(120)"""
    else:
        code = f"""
            import time
            from tasks.runtime.lock import WorkspaceLock
            lock = WorkspaceLock({str(root)!r}, {kind!r}, timeout=0).acquire()
            print("held", lock.token, flush=True); time.sleep(120)"""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    line = proc.stdout.readline()
    assert line.startswith("held"), line
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_second_holder_fails_naming_the_holder_after_the_timeout(tmp_path):
    with WorkspaceLock(tmp_path, "flow", timeout=0) as first:
        assert first.token and holder(tmp_path).token == first.token
        start = time.monotonic()
        with pytest.raises(WorkspaceLocked) as err:
            WorkspaceLock(tmp_path, "stage", timeout=0.6).acquire()
        assert time.monotonic() - start >= 0.5  # it waited the timeout
        msg = str(err.value)
        for part in (f"pid {os.getpid()}", "(flow: ", "since 20", "pipeline.lock_timeout", str(tmp_path)):
            assert part in msg, (part, msg)
    assert holder(tmp_path) is None
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released cleanly: no stale record left


def test_a_waiting_run_gets_the_lock_when_the_holder_finishes(tmp_path):
    first = WorkspaceLock(tmp_path, "flow", timeout=0).acquire()
    threading.Timer(0.7, first.release).start()
    waits = []
    start = time.monotonic()
    with WorkspaceLock(tmp_path, "stage", timeout=20, on_wait=waits.append) as second:
        assert holder(tmp_path).token == second.token
    assert 0.5 < time.monotonic() - start < 10
    assert len(waits) == 1 and "waiting up to 20 s" in waits[0]


def test_a_killed_holders_lock_is_taken_over_as_stale(tmp_path):
    proc = _hold_in_child(tmp_path)
    live = holder(tmp_path)
    assert live is not None and live.pid == proc.pid and live.kind == "flow"
    with pytest.raises(WorkspaceLocked, match=f"pid {proc.pid}"):
        WorkspaceLock(tmp_path, "flow", timeout=0).acquire()
    _kill(proc)  # SIGKILL: no cleanup ran; the record is still in the file
    assert str(proc.pid) in (tmp_path / LOCK_FILE).read_text()
    said = []
    with WorkspaceLock(tmp_path, "flow", timeout=0, on_stale=said.append) as lock:
        assert lock.stale is not None and lock.stale.pid == proc.pid
        assert said and f"stale workspace lock left by pid {proc.pid}" in said[0]
        assert holder(tmp_path).pid == os.getpid()


def test_a_stage_runs_under_its_flows_token_and_refuses_a_wrong_one(tmp_path):
    with WorkspaceLock(tmp_path, "flow", timeout=0) as flow:
        with WorkspaceLock(tmp_path, "stage", timeout=0, token=flow.token) as stage:
            assert stage.token == flow.token
        assert holder(tmp_path).token == flow.token  # the stage's exit did not release the flow's lock
        with pytest.raises(WorkspaceLocked, match="runs under the lock of its flow"):
            WorkspaceLock(tmp_path, "stage", timeout=0, token="0" * 32).acquire()
    with pytest.raises(WorkspaceLocked, match="nobody holds the workspace"):
        WorkspaceLock(tmp_path, "stage", timeout=0, token=flow.token or "x" * 32).acquire()


def test_a_dvc_repro_stage_does_not_wait_on_a_flow(tmp_path, monkeypatch):
    proc = _hold_in_child(tmp_path, "flow")
    try:
        monkeypatch.setenv("DVC_STAGE", "ingest@bbc")
        start = time.monotonic()
        with pytest.raises(WorkspaceLocked, match="runs under `dvc repro`"):
            WorkspaceLock(tmp_path, "stage", timeout=30).acquire()
        assert time.monotonic() - start < 5  # failed at once, not after 30 s
    finally:
        _kill(proc)


def test_the_flow_waits_for_dvcs_lock(tmp_path):
    proc = _hold_in_child(tmp_path, path=str(tmp_path / ".dvc" / "tmp" / "lock"))
    try:
        assert dvc_holder(tmp_path).startswith(f"pid {proc.pid}")
        with pytest.raises(WorkspaceLocked, match=f"DVC's lock is held by pid {proc.pid}"):
            WorkspaceLock(tmp_path, "flow", timeout=0.3, require_dvc_idle=True).acquire()
        assert holder(tmp_path) is None  # it did not keep the workspace while waiting for DVC
        with WorkspaceLock(tmp_path, "stage", timeout=0):  # a stage does not need DVC's lock
            pass
    finally:
        _kill(proc)
    with WorkspaceLock(tmp_path, "flow", timeout=0, require_dvc_idle=True):
        pass


def test_negative_timeout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="timeout must be >= 0 seconds, got -1"):
        WorkspaceLock(tmp_path, "flow", timeout=-1)


def test_crucible_stage_fails_clearly_while_another_run_holds_the_workspace(tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny", overrides={"pipeline": {"lock_timeout": 1}})
    proc = _hold_in_child(root, "flow")
    try:
        out = subprocess.run(
            [str(Path(sys.executable).with_name("crucible")), "stage", "ingest", "--task", "bbc", "--root", str(root)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        _kill(proc)
    assert out.returncode == 3, out.stderr
    assert f"the workspace is locked by pid {proc.pid}" in out.stderr and "gave up after waiting 1 s" in out.stderr
    assert not (root / "data").exists()  # nothing written


def test_crucible_run_says_who_holds_the_workspace_and_how_long_it_waits(tmp_path, project_root):
    """`crucible run` waiting for the lock says so at once on stderr, as `crucible stage` does: the
    holder (pid, command, since when) and the wait (pipeline.lock_timeout); then fails (exit 3)."""
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny", overrides={"pipeline": {"lock_timeout": 2}})
    proc = _hold_in_child(root, "stage")
    try:
        out = subprocess.run(
            [str(Path(sys.executable).with_name("crucible")), "run", "--root", str(root)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PREFECT_HOME": str(root / ".prefect")},
        )
    finally:
        _kill(proc)
    assert out.returncode == 3, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("crucible: ")]
    assert said and said[0] == (
        f"crucible: the workspace is locked by {holder_text(root, proc.pid)}; waiting up to 2 s"
    ), out.stderr[-3000:]
    assert "gave up after waiting 2 s (pipeline.lock_timeout)" in out.stderr


def test_a_waiting_profile_run_changes_nothing_in_the_workspace_it_waits_for(tmp_path, project_root):
    """A second `crucible run --profile X` on a workspace another run holds takes the lock before it
    writes anything: its params (here another quantize rank), dvc.yaml and code are not copied in
    while the holder runs; it gives up after pipeline.lock_timeout with exit 3."""
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny")
    profile = tmp_path / "other.yaml"
    profile.write_text("extends: tiny\npipeline: {lock_timeout: 2}\nquantize: {rank_per_matrix: 4}\n")
    watched = [root / "params.yaml", root / "dvc.yaml", root / "tasks" / "stages" / "quantize.py"]
    (root / "tasks" / "stages" / "quantize.py").write_text("# the holder's code\n")
    before = {p: p.read_bytes() for p in watched}
    proc = _hold_in_child(root, "flow")
    try:
        out = subprocess.run(
            [
                str(Path(sys.executable).with_name("crucible")),
                "run",
                "--profile",
                str(profile),
                "--workspace",
                str(root),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=project_root,
            env={**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")},
        )
    finally:
        _kill(proc)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "gave up after waiting 2 s (pipeline.lock_timeout)" in out.stderr, out.stderr[-3000:]
    assert {p: p.read_bytes() for p in watched} == before


def holder_text(root: Path, pid: int) -> str:
    """How the lock describes the child of _hold_in_child that held `root` (its record stays after it died)."""
    record = json.loads((root / LOCK_FILE).read_text())
    assert record["pid"] == pid
    return f"pid {pid} on {record['host']} (stage: {record['command']}), since {record['since']}"


def test_flock_is_per_open_file_so_threads_of_one_process_exclude_each_other(tmp_path):
    # the flow holds the lock in one thread while its stages check it from others: a second
    # descriptor in the same process must see the lock as held
    (tmp_path / ".crucible").mkdir()
    with open(tmp_path / LOCK_FILE, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert holder(tmp_path) is not None


def test_a_stage_sets_torch_and_blas_threads(tmp_path, project_root):
    # BLAS sums split by thread count as torch's do (ingest's proxy scores differed under Dask,
    # whose workers start with OMP/OPENBLAS_NUM_THREADS=1): a stage sets both, in a fresh process
    code = textwrap.dedent(f"""
        import json, numpy, torch
        from threadpoolctl import threadpool_info
        from tasks.stages import execute
        from tasks.runtime.workspace import make_workspace
        root = make_workspace({str(project_root)!r}, {str(tmp_path / "ws")!r}, "tiny")
        execute("ingest", "trec", root, threads=1)
        blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        print(json.dumps({{"torch": torch.get_num_threads(), "blas": blas}}))""")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=project_root,
        env={k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == 1 and got["blas"] and set(got["blas"]) == {1}, got
