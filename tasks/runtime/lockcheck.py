"""A stage's inputs checked against what their producer recorded, before the stage reads them.

`execute` (tasks/runtime/stage.py) hashes every file a stage declares as a dependency and calls
`check` before the stage runs: a file that an earlier stage wrote must still be what that stage
wrote. dvc.lock records it (a file output's md5; a folder output's `<md5>.dir`, DVC's hash of its
files); a file whose bytes differ (a weight edited, a file truncated or copied in by hand) stops the
stage with `StaleInput`, one line naming the file, both hashes and the command that rebuilds it, and
nothing is read or written.

Whose record counts, and when:
- dvc.lock's entry of the producing stage. `dvc repro` writes it as each stage finishes; the Prefect
  flow (flows/pipeline.py) runs `dvc commit` for each batch of finished runs before it starts any run
  that reads them, so the entry is there when the reader starts.
- The producer's own record of its last successful run, `.crucible/outputs/<stage id>.json`
  (`record`, written by `execute` once the outputs are published). A stage run on its own
  (`crucible stage finetune --task bbc`) rewrites its outputs without touching dvc.lock; a file that
  differs from dvc.lock but is what its producer last wrote is accepted (as is the other way round:
  after `git checkout` + `dvc checkout` of another revision the files are dvc.lock's).
- No dvc.lock, or no entry for the producer (a first run before anything was committed, a workspace
  that is not a DVC project, a file no stage writes such as inputs/): nothing to check against, and
  the stage's own readers are the only check. A record alone is never enforced.

Cost: the hashes are those the runner computes anyway for the lineage tags (io.md5_file keeps each
file's md5 for the process, by path, size and times); a folder output's `.dir` hash is built from
them as DVC builds it. Under `dvc repro` a changed upstream output makes DVC rerun its producer
first, so the check rarely fires there; it guards `crucible stage X` and a file changed mid-run.
"""

from __future__ import annotations

import configparser
import contextlib
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from tasks.runtime.declaration import files_under
from tasks.runtime.io import AtomicOutputs, md5_file, rebuild_hint

LOCK = "dvc.lock"
RECORDS = Path(".crucible") / "outputs"
# DVC rewrites dvc.lock in place (truncate, then write), so a stage starting while the flow's `dvc
# commit` runs could read an empty or half-written file: the commit holds this file's flock
# exclusively, a reader shared (flock is per open file, so threads of one process exclude each other)
GUARD = Path(".crucible") / "dvc.lock.guard"


class StaleInput(ValueError):
    """An input that is not what its producer wrote (a ValueError: `crucible stage` exits 2)."""


@contextlib.contextmanager
def guard(root: Path, exclusive: bool):
    """Hold GUARD's flock: exclusively while dvc.lock is rewritten (the flow's `dvc commit`), shared
    while it is read."""
    path = Path(root) / GUARD
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the flock


def read_lock(root: Path, tries: int = 5) -> dict | None:
    """dvc.lock's stages ({stage id: entry}), or None if there is no dvc.lock. Read under `guard`; a
    writer that does not take it (a `dvc commit` by hand) could still be caught mid-write: a file
    that does not parse or has no stages is read again a few times before it is an error."""
    import yaml

    path = Path(root) / LOCK
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for attempt in range(tries):
        last = attempt == tries - 1
        with guard(root, exclusive=False):
            if not path.is_file():
                return None
            text = path.read_text()
        try:
            data = yaml.load(text, Loader=loader) or {}
        except yaml.YAMLError as exc:
            if last:
                raise ValueError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
            time.sleep(0.5)
            continue
        stages = data.get("stages") if isinstance(data, dict) else None
        if isinstance(stages, dict):
            return stages
        if last:
            raise ValueError(f"{path}: no 'stages' mapping; not a dvc.lock file")
        time.sleep(0.5)
    raise AssertionError("unreachable")


def record(root: Path, sid: str, written: dict[str, str]) -> None:
    """Record the outputs ({path: md5}) that run `sid` of a stage has just published."""
    with AtomicOutputs() as out:
        out.json({"stage": sid, "outputs": written}, Path(root) / RECORDS / f"{sid}.json")


def recorded(root: Path, sid: str) -> dict[str, str]:
    """The outputs ({path: md5}) that the last successful run `sid` recorded; {} if none."""
    try:
        data = json.loads((Path(root) / RECORDS / f"{sid}.json").read_text())
    except (OSError, ValueError):
        return {}
    outputs = data.get("outputs") if isinstance(data, dict) else None
    return outputs if isinstance(outputs, dict) else {}


def dir_hash(files: dict[str, str]) -> str:
    """DVC's hash of a folder ({path relative to it: md5}): the md5 of its sorted listing, `.dir`."""
    listing = [{"md5": h, "relpath": p} for p, h in sorted(files.items())]
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def _dvc_cache(root: Path) -> Path:
    """The DVC cache folder of the project at `root` (`cache.dir` of .dvc/config, else .dvc/cache)."""
    dvc = Path(root) / ".dvc"
    for name in ("config.local", "config"):
        parser = configparser.ConfigParser()
        try:
            parser.read(dvc / name)
        except configparser.Error:
            continue
        if parser.has_option("cache", "dir"):
            return (dvc / parser.get("cache", "dir")).resolve()
    return dvc / "cache"


def _manifest(root: Path, value: str) -> dict[str, str] | None:
    """The listing ({relpath: md5}) of a folder output with hash `value`, from the DVC cache, if there."""
    path = _dvc_cache(root) / "files" / "md5" / value[:2] / value[2:]
    try:
        entries = json.loads(path.read_text())
        return {e["relpath"]: e["md5"] for e in entries}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _producers(lock: dict, reader: str) -> dict[str, tuple[str, str]]:
    """{output path: (stage id, md5)} of every output dvc.lock records, but the reader's own."""
    outs = {}
    for sid, entry in lock.items():
        if sid == reader or not isinstance(entry, dict):
            continue
        for out in entry.get("outs") or []:
            if isinstance(out, dict) and out.get("path") and out.get("md5"):
                outs[str(out["path"]).rstrip("/")] = (sid, str(out["md5"]))
    return outs


def check(root: Path, reader: str, read: dict[str, str]) -> None:
    """Raise StaleInput if a file of `read` ({path relative to `root`: its md5 now}), the inputs of
    stage run `reader`, is neither what dvc.lock records for its producer's output nor what that
    producer recorded at its last run."""
    root = Path(root)
    lock = read_lock(root)
    outs = _producers(lock, reader) if lock else {}
    if not outs:
        return
    mine: dict[str, dict[str, str]] = {}

    def last_run(sid: str) -> dict[str, str]:
        if sid not in mine:
            mine[sid] = recorded(root, sid)
        return mine[sid]

    bad: list[tuple[str, str, str, str]] = []  # (path, producer, md5 recorded, md5 now)
    folders: dict[str, list[str]] = {}
    for path, now in read.items():
        if path in outs:
            sid, want = outs[path]
            if now != want and last_run(sid).get(path) != now:
                bad.append((path, sid, want, now))
            continue
        folder = next((p for p in outs if outs[p][1].endswith(".dir") and path.startswith(p + "/")), None)
        if folder is not None:
            folders.setdefault(folder, []).append(path)
    for folder, paths in folders.items():
        sid, want = outs[folder]
        unexcused = [p for p in paths if last_run(sid).get(p) != read[p]]
        if not unexcused:
            continue
        files = {p.relative_to(folder).as_posix(): md5_file(root / p) for p in files_under(root, folder)}
        if dir_hash(files) == want:
            continue
        listing = _manifest(root, want)
        if listing is None:  # which file differs is in the cache only: name the folder
            bad.append((folder, sid, want, dir_hash(files)))
            continue
        for p in unexcused:
            expected = listing.get(Path(p).relative_to(folder).as_posix())
            if expected != read[p]:
                bad.append((p, sid, expected or f"no such file in {folder}", read[p]))
    if bad:
        raise StaleInput(_message(root, reader, bad))


def _message(root: Path, reader: str, bad: list[tuple[str, str, str, str]]) -> str:
    path, sid, want, now = bad[0]
    stage, _, task = sid.partition("@")
    more = f"; {len(bad) - 1} more changed: {', '.join(b[0] for b in bad[1:4])}" if len(bad) > 1 else ""
    more += ", ..." if len(bad) > 4 else ""
    return (
        f"{root / path}: md5 {now} is not what stage {sid} wrote (dvc.lock records {want}); it changed after that "
        f"run, and {reader} will not read it: {rebuild_hint(stage, task or None)}{more}"
    )
