"""Temporary files that a killed run cannot leave behind.

Everything a stage writes temporarily lives in the workspace, never in the system's temporary
directory, and carries its owner: the process id and host in its name (`<pid>@<host>`). A sweep
removes only what belongs to a process of this host that is gone, so two runs in one workspace
never delete each other's live files, and a crashed run's leftovers go at the next start.

- `scratch(root, prefix)`: a private folder under `<root>/.crucible/tmp/`, removed on exit;
- `owner_tag()` / `owner_alive(tag)`: the tag that AtomicOutputs puts in its temporary file names;
- `sweep(root, folders)`: remove dead owners' scratch folders and temporary files (`.*.tmp`) in
  `folders`; `execute` calls it before every stage, on the stage's output folders.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SCRATCH = Path(".crucible") / "tmp"
# `<name>.<pid>@<host>.<random>.tmp` (AtomicOutputs) and `<prefix>-<pid>@<host>-<random>` (scratch)
_TAG = re.compile(r"[.-](\d+)@([A-Za-z0-9_]+)[.-][^.@]+(?:\.tmp)?$")
_LEGACY_AGE_S = 3600.0  # a temporary file without an owner tag (older crucible) counts as stale after this


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def owner_tag() -> str:
    return f"{os.getpid()}@{_host()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def owner_alive(name: str) -> bool | None:
    """Whether the owner of a tagged file or folder name still runs: True/False on this host, None
    when the name has no tag or names another host (then only its age can tell)."""
    m = _TAG.search(name)
    if not m:
        return None
    pid, host = int(m.group(1)), m.group(2)
    if host != _host():
        return None
    return pid_alive(pid)


def tag_alive(tag: str) -> bool | None:
    """Whether the process of an owner tag `<pid>@<host>` still runs (None: another host, or no tag)."""
    m = re.fullmatch(r"(\d+)@([A-Za-z0-9_]+)", tag or "")
    if not m or m.group(2) != _host():
        return None
    return pid_alive(int(m.group(1)))


def _stale(path: Path) -> bool:
    alive = owner_alive(path.name)
    if alive is not None:
        return not alive
    try:
        return time.time() - path.stat().st_mtime > _LEGACY_AGE_S
    except FileNotFoundError:
        return False


def sweep_files(folder: Path | str) -> list[Path]:
    """Remove the `.*.tmp` files of dead owners in `folder`."""
    removed = []
    folder = Path(folder)
    if folder.is_dir():
        for tmp in folder.glob(".*.tmp"):
            if _stale(tmp):
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    return removed


def sweep(root: Path | str, folders=()) -> list[Path]:
    """Remove dead owners' scratch folders under <root>/.crucible/tmp and their `.*.tmp` files in
    `folders` (relative to root, or absolute). Returns what was removed."""
    root = Path(root)
    removed = []
    base = root / SCRATCH
    if base.is_dir():
        for entry in base.iterdir():
            if _stale(entry):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
    for folder in sorted({root / f for f in folders}):
        removed += sweep_files(folder)
    return removed


@contextmanager
def scratch(root: Path | str, prefix: str) -> Iterator[Path]:
    """A private temporary folder in the workspace (<root>/.crucible/tmp/<prefix>-<pid>@<host>-*),
    removed when the block exits, however it exits; a killed run's folder goes at the next sweep."""
    base = Path(root) / SCRATCH
    base.mkdir(parents=True, exist_ok=True)
    sweep(root)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{owner_tag()}-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
