"""Servers that die with the command that started them.

A `crucible run`, `ui` or `deploy` killed with SIGKILL (an OOM kill, `kill -9`, a scheduler) runs no
cleanup: without help, the servers it started (Prefect's temporary API server, the MLflow UI, a
Prefect server, the deployments' serving process) go on running, a few hundred MB each, until
someone finds them. So each server gets a watchdog: a small process (`python -m flows.children`,
standard library only) in its own session, so Ctrl-C in the terminal does not reach it, that waits
on both pids (pidfds, no polling where the kernel has them) and, when the parent goes first, sends
SIGTERM to the server's process group (the server and anything it started), then SIGKILL after a
grace period. When the server ends first, the watchdog just exits.

A watchdog rather than PR_SET_PDEATHSIG: the kernel sends that signal when the *thread* that forked
the child ends, and Prefect starts its temporary server from whichever thread first needs the API
(a worker thread that may end long before the process); and it reaches no grandchild (the MLflow
UI runs its server in a child process).

- `spawn(cmd, ...)`: Popen in a new session (the server leads its own process group) plus a watchdog;
  what `crucible ui` and `crucible deploy` start their servers with.
- `guard_prefect_server()`: the same for the temporary API server Prefect starts itself when no
  PREFECT_API_URL is set (`crucible run`): every server process it starts gets a watchdog.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE = 5.0  # seconds between SIGTERM and SIGKILL


def watch(child: subprocess.Popen, grace: float = GRACE) -> subprocess.Popen:
    """A watchdog that ends `child` (its process group when it leads one) once this process is gone."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.children", str(os.getpid()), str(child.pid), str(grace)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C and a kill of our process group leave it standing
        close_fds=True,
    )


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """`cmd` in a new session (so the watchdog and a stop can signal its whole group), watched."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    watch(proc)
    return proc


def stop_group(proc: subprocess.Popen, sig: int | None = signal.SIGINT, timeout: float = 10.0) -> None:
    """Stop a `spawn`ed process and what it started: `sig` to its group (as Ctrl-C would; None: it
    was sent already), SIGTERM if it has not exited within `timeout` seconds, then SIGKILL to the
    group: what it started and left behind, or itself when it would not stop."""
    for send, wait in ((sig, timeout), (signal.SIGTERM, GRACE)):
        if proc.poll() is not None:
            break
        try:
            if send is not None:
                os.killpg(proc.pid, send)
            proc.wait(timeout=wait)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def guard_prefect_server() -> None:
    """Give every temporary API server Prefect starts in this process a watchdog (idempotent)."""
    from prefect.server.api.server import SubprocessASGIServer

    start = SubprocessASGIServer._run_uvicorn_command
    if getattr(start, "_crucible_watched", False):
        return

    def _run_uvicorn_command(self) -> subprocess.Popen:
        proc = start(self)
        watch(proc)
        return proc

    _run_uvicorn_command._crucible_watched = True
    SubprocessASGIServer._run_uvicorn_command = _run_uvicorn_command


# the watchdog process ---------------------------------------------------------------------------


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (old kernel, not Linux), or already gone
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _wait_either(parent: int, child: int, parent_fd: int | None, child_fd: int | None) -> bool:
    """Block until the parent or the child ends; True when the parent went first."""
    if parent_fd is not None and child_fd is not None:
        ready, _, _ = select.select([parent_fd, child_fd], [], [])
        return child_fd not in ready
    while True:
        if os.getppid() != parent:
            return True
        if not _alive(child):
            return False
        time.sleep(0.5)


def _signal(child: int, child_fd: int | None, group: bool, sig: int) -> None:
    try:
        if group:
            os.killpg(child, sig)
        elif child_fd is not None:
            signal.pidfd_send_signal(child_fd, sig)
        else:
            os.kill(child, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _guard(parent: int, child: int, grace: float) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the parent's end or the child's ends the watch
    child_fd = _pidfd(child)
    try:
        group = os.getpgid(child) == child
    except ProcessLookupError:
        return 0
    parent_fd = _pidfd(parent)
    if os.getppid() != parent:  # it ended before we were watching: no wait
        parent_gone = True
    else:
        parent_gone = _wait_either(parent, child, parent_fd, child_fd)
    if not parent_gone:
        return 0
    _signal(child, child_fd, group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    _signal(child, child_fd, group, signal.SIGKILL)  # the group's stragglers, or a child that would not stop
    return 0


if __name__ == "__main__":  # python -m flows.children PARENT_PID CHILD_PID GRACE
    sys.exit(_guard(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
