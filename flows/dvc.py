"""The two DVC calls the Prefect flow makes, so a flow run leaves DVC's state consistent.

Before a stage: `dvc status <stage> --json` (skip it when up to date). After it: `dvc commit
--force <stage>` records its deps, params and outs in dvc.lock exactly as `dvc repro` would, so a
following `dvc repro` is a no-op. DVC takes a repository lock, so calls are made one at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tasks.runtime import lockcheck

_LOCK = threading.Lock()
# what DVC says while another dvc process holds its repository lock (.dvc/tmp/lock) or the
# read/write lock on a path a stage reads or writes (.dvc/tmp/rwlock)
_BUSY = ("Unable to acquire lock", "is busy, it is being blocked by")


def _dvc(root: Path, *args: str, wait: float = 60.0) -> subprocess.CompletedProcess:
    """Run a dvc command; while another dvc command holds DVC's repository lock or its per-path
    read/write lock on a stage's files (a `dvc repro` starting beside the flow: its stages refuse to
    run while the flow holds the workspace, so it exits at once), retry for up to `wait` seconds."""
    exe = Path(sys.executable).with_name("dvc")
    cmd = [str(exe) if exe.exists() else "dvc", *args]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    deadline = time.monotonic() + wait
    while True:
        with _LOCK:
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
        said = proc.stderr + proc.stdout
        if proc.returncode == 0 or not any(m in said for m in _BUSY) or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd[1:])}` failed in {root} (exit {proc.returncode}):\n"
            f"{(proc.stderr + proc.stdout).strip()[-2000:]}"
        )
    return proc


def is_dvc_project(root: Path) -> bool:
    return (Path(root) / ".dvc").is_dir() and (Path(root) / "dvc.yaml").is_file()


def stale(root: Path, stages: list[str], wait: float = 60.0) -> set[str]:
    """The stages among `stages` that DVC would run (deps, params, cmd or outs differ from dvc.lock).
    One `dvc status` call for all of them."""
    if not stages:
        return set()
    out = _dvc(root, "status", *stages, "--json", wait=wait).stdout.strip()
    changed = json.loads(out or "{}")
    unknown = set(changed) - set(stages)
    if unknown:  # upstream stages are not reported without --with-deps; anything else is a surprise
        raise RuntimeError(f"`dvc status` reported stages that were not asked about: {sorted(unknown)}")
    return set(changed)


def commit(root: Path, stages: list[str], wait: float = 60.0) -> None:
    """Record finished stages in dvc.lock, as `dvc repro` would have."""
    if stages:
        with lockcheck.guard(root, exclusive=True):  # DVC rewrites dvc.lock in place: no stage reads it meanwhile
            _dvc(root, "commit", "--force", *stages, wait=wait)  # not --quiet: it hides the lock error
