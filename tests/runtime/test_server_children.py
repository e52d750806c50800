"""Servers die with the command that started them, even a SIGKILLed one (flows/children.py): the
servers `crucible ui` and `deploy` start (and what those start in turn), and the temporary API
server Prefect starts for `crucible run`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.registry.serving import free_port

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie waiting for init is gone
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if not _gone(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if not _gone(p)]


def _parent(code: str, tmp_path: Path, timeout: float = 240) -> tuple[subprocess.Popen, list[int]]:
    """A Python process running `code`, which prints the pids to watch on one line then sleeps."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # blocks until the children are up (or the parent died)
    assert line.strip(), f"the parent printed no pids (exit {proc.poll()})"
    return proc, [int(p) for p in line.split()]


def _kill_and_check(proc: subprocess.Popen, pids: list[int]) -> None:
    try:
        assert not [p for p in pids if _gone(p)], "a child ended before its parent was killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = _wait_gone(pids, timeout=10)
        assert not left, f"still running 10 s after their parent was SIGKILLed: {left}"
    finally:
        for p in pids:  # whatever the outcome, leave nothing running
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_spawned_server_and_what_it_started_die_with_a_sigkilled_parent(tmp_path):
    proc, pids = _parent(
        """
        import subprocess, sys, time
        from flows.children import spawn
        server = spawn(
            [sys.executable, "-c", "import subprocess, sys, time; "
             "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
             "print(c.pid, flush=True); time.sleep(600)"],
            stdout=subprocess.PIPE, text=True,
        )
        grandchild = server.stdout.readline().strip()
        print(server.pid, grandchild, flush=True)
        time.sleep(600)
        """,
        tmp_path,
    )
    _kill_and_check(proc, pids)


@pytest.mark.long
def test_prefects_temporary_server_dies_with_a_sigkilled_run(tmp_path):
    """What `crucible run` does without PREFECT_API_URL: run_pipeline guards the server Prefect starts."""
    port = free_port()
    proc, pids = _parent(
        f"""
        import time
        from unittest import mock
        import flows.pipeline as fp
        from prefect.server.api.server import SubprocessASGIServer

        def flow(**kwargs):  # what the flow's first API call does: start the temporary server
            server = SubprocessASGIServer({port})
            server.start()
            print(server.server_process.pid, flush=True)
            time.sleep(600)

        with mock.patch.object(fp, "pipeline", mock.Mock(with_options=lambda **kw: flow)):
            fp.run_pipeline({str(ROOT)!r})
        """,
        tmp_path,
    )
    _kill_and_check(proc, pids)


def test_a_stopped_group_leaves_nothing_behind():
    from flows.children import spawn, stop_group

    server = spawn(
        [
            sys.executable,
            "-c",
            "import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)']); print(c.pid, flush=True); "
            "time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    grandchild = int(server.stdout.readline())
    start = time.monotonic()
    stop_group(server, signal.SIGINT, timeout=0.5)  # ignored: SIGTERM, then SIGKILL for the group
    assert server.returncode is not None and time.monotonic() - start < 15
    assert not _wait_gone([grandchild], timeout=5)


@pytest.mark.slow
@pytest.mark.operations
def test_crucible_ui_killed_leaves_no_server(tmp_path):
    """`crucible ui` SIGKILLed once both servers answer: the MLflow UI, its server process and the
    Prefect server all end."""
    import urllib.request

    mlflow_port, prefect_port = free_port(), free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("crucible")),
            "ui",
            "--root",
            str(tmp_path),
            "--mlflow-port",
            str(mlflow_port),
            "--prefect-port",
            str(prefect_port),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        for url in (f"http://127.0.0.1:{mlflow_port}/health", f"http://127.0.0.1:{prefect_port}/api/health"):
            while True:
                assert time.monotonic() < deadline, f"{url} did not answer"
                try:
                    with urllib.request.urlopen(url, timeout=2):
                        break
                except OSError:
                    time.sleep(1)
        import psutil

        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        servers = [p for p in pids if "flows.children" not in " ".join(psutil.Process(p).cmdline())]
        assert len(servers) >= 3, "the MLflow UI, its server and the Prefect server"
    except BaseException:
        proc.kill()
        raise
    _kill_and_check(proc, pids)
