"""One pipeline run per workspace at a time.

Two runs on one workspace (two flows, a flow and `dvc repro`, two `crucible stage` of one stage)
would write the same outputs at once, and one's atomic-output sweep would delete the other's live
temporary files. So every run holds the workspace lock, `<root>/.crucible/lock`:

- `crucible run` (the flow) holds it for the whole run and hands its token to its stages, which
  may run in other threads or other processes (Dask and Ray workers): a stage that carries the
  holder's token runs under the holder's lock;
- `crucible stage` (what `dvc repro` calls, or a user by hand) holds it for the stage.

A second run waits up to `pipeline.lock_timeout` seconds, then fails with a message naming the
holder (pid, host, command, since when). The lock is an `flock` on the file, so the kernel frees
it when the holder dies, however it dies; the holder's record stays in the file, and the next run
reports it as a stale lock it took over.

`dvc repro` holds DVC's own repository lock for its whole run, and the flow needs that lock for
a moment before and after each stage (`dvc status`, `dvc commit`). So the flow starts only when
neither lock is held, and a stage run by `dvc repro` (DVC_STAGE is set) fails at once, instead of
waiting, when a flow holds the workspace: waiting would deadlock the two.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = Path(".crucible") / "lock"
DVC_LOCK_FILE = Path(".dvc") / "tmp" / "lock"
POLL_S = 0.5


class WorkspaceLocked(RuntimeError):
    """Another run holds the workspace (or DVC's lock) past the timeout."""


@dataclass
class Holder:
    pid: int
    host: str
    command: str
    kind: str  # "flow" | "stage"
    since: str  # ISO 8601, UTC
    token: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} ({self.kind}: {self.command}), since {self.since}"


def _this_command() -> str:
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv and sys.argv[0] else "python"


def _read_record(path: Path) -> Holder | None:
    try:
        text = path.read_text()
    except (FileNotFoundError, OSError):
        return None
    if not text.strip():
        return None
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return None  # a half-written or foreign record: the holder is unknown, not an error


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


def is_locked(path: Path) -> bool:
    """Whether some process holds an flock on `path` (False when the file is absent)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if _try_flock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def holder(root: Path | str) -> Holder | None:
    """The live holder of `root`'s workspace lock, or None when nobody holds it."""
    path = Path(root) / LOCK_FILE
    if not is_locked(path):
        return None
    return _read_record(path) or Holder(0, "?", "unknown (it is starting)", "?", "?", "")


def dvc_holder(root: Path | str) -> str | None:
    """Who holds DVC's repository lock in `root` (a `dvc` command is running), or None."""
    path = Path(root) / DVC_LOCK_FILE
    if not is_locked(path):
        return None
    pid = path.read_text().strip().split()[0] if path.exists() and path.read_text().strip() else "?"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (OSError, ValueError):
        cmd = "dvc"
    return f"pid {pid} on {socket.gethostname()} ({cmd or 'dvc'})"


class WorkspaceLock:
    """`with WorkspaceLock(root, "stage", timeout=600): ...` holds the workspace for the block.

    `token`, when given and equal to the live holder's token, means "I run under the holder's
    lock" (a stage of the flow that holds it): nothing is acquired. `require_dvc_idle` (the flow)
    also waits until no `dvc` command holds DVC's lock. `on_wait(message)` is called once when
    the lock is busy (to tell the user what it waits for)."""

    def __init__(
        self,
        root: Path | str,
        kind: str,
        timeout: float,
        token: str | None = None,
        require_dvc_idle: bool = False,
        on_wait=None,
        on_stale=None,
    ):
        if timeout < 0:
            raise ValueError(f"lock timeout must be >= 0 seconds, got {timeout}")
        self.root = Path(root).resolve()
        self.path = self.root / LOCK_FILE
        self.kind, self.timeout, self.given_token = kind, float(timeout), token
        self.require_dvc_idle = require_dvc_idle
        self.on_wait, self.on_stale = on_wait, on_stale
        self.token: str | None = None
        self.stale: Holder | None = None
        self._fd: int | None = None
        self._inherited = False

    # -- acquire / release ----------------------------------------------------------------------
    def acquire(self) -> "WorkspaceLock":
        if self.given_token:
            live = holder(self.root)
            if live is None or live.token != self.given_token:
                raise WorkspaceLocked(
                    f"{self.path}: this stage runs under the lock of its flow (token {self.given_token[:8]}), "
                    f"but {'nobody holds the workspace' if live is None else 'it is held by ' + live.describe()}; "
                    "the flow ended or another run took over"
                )
            self.token, self._inherited = self.given_token, True
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout
        told = False
        while True:
            busy, by = self._try_once()
            if busy is None:
                return self
            if os.environ.get("DVC_STAGE") and self.kind == "stage" and by is not None and by.kind == "flow":
                raise WorkspaceLocked(
                    f"{self.root}: {busy}. This stage runs under `dvc repro`, which holds DVC's lock that "
                    "the flow needs, so it does not wait: rerun `dvc repro` when the flow has finished"
                )
            if time.monotonic() >= deadline:
                raise WorkspaceLocked(
                    f"{self.root}: {busy}; gave up after waiting {self.timeout:.0f} s "
                    "(pipeline.lock_timeout). Wait for it to finish, or stop that process"
                )
            if not told and self.on_wait is not None:
                self.on_wait(f"{busy}; waiting up to {self.timeout:.0f} s")
                told = True
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    def _try_once(self) -> tuple[str | None, Holder | None]:
        """Take the lock if both it and (when required) DVC's are free; else (who holds it, the
        workspace holder's record if that is the one)."""
        if self.require_dvc_idle:
            dvc = dvc_holder(self.root)
            if dvc is not None:
                return f"DVC's lock is held by {dvc}", None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_flock(fd):
            os.close(fd)
            live = holder(self.root)
            return (f"the workspace is locked by {live.describe()}" if live else "the workspace is locked"), live
        if self.require_dvc_idle and (dvc := dvc_holder(self.root)) is not None:  # a dvc command started meanwhile
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return f"DVC's lock is held by {dvc}", None
        previous = _read_record(self.path)
        if previous is not None:  # the holder died without releasing: the kernel freed its flock
            self.stale = previous
            if self.on_stale is not None:
                self.on_stale(f"took over a stale workspace lock left by {previous.describe()}")
        self.token = secrets.token_hex(16)
        record = Holder(
            os.getpid(),
            socket.gethostname(),
            _this_command(),
            self.kind,
            datetime.now(timezone.utc).isoformat(timespec="seconds"),
            self.token,
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(record)).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return None, None

    def release(self) -> None:
        if self._inherited:
            self._inherited, self.token = False, None
            return
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty file = released cleanly (not stale)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd, self.token = None, None

    def __enter__(self) -> "WorkspaceLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def wait_for_dvc(root: Path | str, timeout: float, what: str) -> None:
    """Wait (bounded) until no `dvc` command holds DVC's lock in `root`."""
    deadline = time.monotonic() + timeout
    while (busy := dvc_holder(root)) is not None:
        if time.monotonic() >= deadline:
            raise WorkspaceLocked(f"{root}: {what} needs DVC's lock, held by {busy}, for over {timeout:.0f} s")
        time.sleep(POLL_S)
