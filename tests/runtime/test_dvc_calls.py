"""The flow's two DVC calls wait out DVC's repository lock and name the error when they fail."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zc.lockfile

from flows import dvc

DVC = str(Path(sys.executable).with_name("dvc"))


@pytest.fixture()
def project(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([DVC, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text("stages:\n  make:\n    cmd: echo hi > out.txt\n    outs: [out.txt]\n")
    (tmp_path / "out.txt").write_text("hi\n")
    return tmp_path


def test_commit_retries_while_another_dvc_holds_the_lock(project):
    held = zc.lockfile.LockFile(str(project / ".dvc" / "tmp" / "lock"))
    threading.Timer(8.0, held.close).start()  # a `dvc repro` beside the flow lets go after 8 s (DVC itself waits ~3 s)
    dvc.commit(project, ["make"], wait=30)
    assert "out.txt" in (project / "dvc.lock").read_text()


def test_a_failing_call_names_the_command_and_dvc_error(project):
    held = zc.lockfile.LockFile(str(project / ".dvc" / "tmp" / "lock"))
    try:
        with pytest.raises(RuntimeError, match=r"commit --force make.*\n.*Unable to acquire lock"):
            dvc.commit(project, ["make"], wait=1)
    finally:
        held.close()
    with pytest.raises(RuntimeError, match="nosuch"):
        dvc.commit(project, ["nosuch"], wait=1)


def test_commit_retries_while_a_dvc_repro_holds_a_stage_output(project):
    """A `dvc repro` started beside the flow takes DVC's per-path lock on the outputs of the stage it
    tries (which then refuses to run): the flow's commit of that stage waits until it lets go."""
    repro = subprocess.Popen(["sleep", "60"])  # stands in for the `dvc repro` process
    (project / ".dvc" / "tmp").mkdir(exist_ok=True)
    (project / ".dvc" / "tmp" / "rwlock").write_text(
        json.dumps({"write": {str(project / "out.txt"): {"pid": repro.pid, "cmd": "dvc repro"}}, "read": {}})
    )
    threading.Timer(6.0, lambda: (repro.kill(), repro.wait())).start()  # it exits: DVC drops its entry
    try:
        with pytest.raises(RuntimeError, match="is busy, it is being blocked by"):
            dvc.commit(project, ["make"], wait=1)
        dvc.commit(project, ["make"], wait=60)
    finally:
        repro.kill()
    assert "out.txt" in (project / "dvc.lock").read_text()
