"""Lineage of a registered model: what made it, as tags that resolve against dvc.lock.

    crucible lineage champion          # or a version number: crucible lineage 3

The register stage tags each model version with
- `crucible.lineage.git_commit`: the workspace's git commit;
- `crucible.lineage.md5.<path>`: the dvc.lock md5 of every output of every stage that ran before
  it (datasets per task, embeddings, curation, pseudo-labels, the fine-tunes, the merged and the
  quantized model, evaluate's metrics); a directory output has DVC's `<md5>.dir` hash (computed by
  DVC's own tree build on disk, so .dvcignore is honoured);
- `crucible.lineage.params.<stage>` (`<stage>/<task>` for a per-task stage): the params that stage
  ran with, as recorded in dvc.lock (canonical JSON, or `md5:<hash of it>` when too long for a tag).
`compare` checks each against the current dvc.lock and the files on disk; `report` prints it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from tasks.runtime.io import md5_file
from tasks.runtime.lockcheck import LOCK, read_lock

MD5 = "crucible.lineage.md5."
PARAMS = "crucible.lineage.params."
COMMIT = "crucible.lineage.git_commit"
LOCK_STATE = "crucible.lineage.dvc_lock"
MAX_KEY, MAX_VALUE = 250, 5000  # MLflow tag key and (portable) value limits
_BAD_KEY_CHARS = re.compile(r"[^\w.\- /]")


def tag_key(prefix: str, name: str) -> str:
    """A valid MLflow tag key for `name` under `prefix` (characters MLflow refuses become '_')."""
    key = prefix + _BAD_KEY_CHARS.sub("_", name)
    if len(key) > MAX_KEY:
        key = prefix + hashlib.md5(name.encode()).hexdigest()
    return key


def params_key(stage_id: str) -> str:
    """'ingest@bbc' -> crucible.lineage.params.ingest/bbc ('@' is not allowed in tag keys)."""
    return tag_key(PARAMS, stage_id.replace("@", "/"))


def params_value(params) -> str:
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return text if len(text) <= MAX_VALUE else "md5:" + hashlib.md5(text.encode()).hexdigest()


def _stage_params(entry: dict):
    params = entry.get("params") or {}
    # params of params.yaml as they are; any other params file keeps its file name as the key
    return params.get("params.yaml", {}) if set(params) <= {"params.yaml"} else params


def lock_lineage(root: Path, exclude: tuple[str, ...] = ("register",)) -> dict:
    """From dvc.lock: {"md5": {path: md5}, "params": {stage id: params}} over every stage except
    `exclude` (and its per-task instances)."""
    stages = read_lock(root) or {}
    md5, params = {}, {}
    for sid, entry in stages.items():
        if sid.split("@")[0] in exclude:
            continue
        for out in entry.get("outs") or []:
            if out.get("md5"):
                md5[out["path"]] = out["md5"]
        params[sid] = _stage_params(entry)
    return {"md5": md5, "params": params}


def lineage_tags(root: Path, commit: str, exclude: tuple[str, ...] = ("register",)) -> dict[str, str]:
    """The lineage tags of a model made from workspace `root` now."""
    root = Path(root)
    tags = {COMMIT: commit, LOCK_STATE: "present" if (root / LOCK).is_file() else "missing"}
    lineage = lock_lineage(root, exclude)
    for path, h in lineage["md5"].items():
        tags[tag_key(MD5, path)] = h
    for sid, p in lineage["params"].items():
        tags[params_key(sid)] = params_value(p)
    return tags


@contextlib.contextmanager
def dvc_dir_hasher(root: Path):
    """A function path -> DVC's hash (`<md5>.dir`) of the directory `path` inside the DVC repository
    `root`, computed by DVC itself (dvc_data's tree build, as for a stage's directory output): the
    value dvc.lock records, honouring .dvcignore. Nothing is written to the cache."""
    from dvc.repo import Repo
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_objects.fs import MemoryFileSystem

    with Repo(os.fspath(root), uninitialized=True) as repo:
        # outside a DVC repository (no cache): an in-memory object store; the hashes are the same
        odb = repo.cache.repo if repo.cache.repo is not None else HashFileDB(MemoryFileSystem(), "/crucible-lineage")

        def hash_dir(path: Path) -> str:
            _, _, obj = build(odb, os.fspath(Path(path).resolve()), repo.fs, "md5", ignore=repo.dvcignore, dry_run=True)
            return obj.hash_info.value

        yield hash_dir


def _dvc_root(path: Path) -> Path:
    """The DVC repository holding `path` (its nearest ancestor with a .dvc folder), else its parent."""
    path = Path(path).resolve()
    return next((p for p in path.parents if (p / ".dvc").is_dir()), path.parent)


def dir_md5(path: Path, root: Path | None = None) -> str:
    """DVC's hash of a directory output (dvc_dir_hasher); `root`: its DVC repository (default: the
    nearest one above it)."""
    with dvc_dir_hasher(root if root is not None else _dvc_root(path)) as hash_dir:
        return hash_dir(path)


def disk_md5(path: Path, hash_dir=dir_md5) -> str | None:
    """The hash dvc.lock would record for `path` now: DVC's directory hash, a file's md5, None
    when it does not exist."""
    path = Path(path)
    if path.is_dir():
        return hash_dir(path)
    if path.is_file():
        return md5_file(path)
    return None


def compare(root: Path, tags: dict[str, str], commit: str | None = None) -> dict:
    """Each lineage tag of a version against the workspace `root`: for artifacts the current
    dvc.lock md5 and the md5 on disk, for params the current dvc.lock params, the git commit;
    `matches` is true when everything recorded is still what the workspace holds."""
    root = Path(root)
    lineage = lock_lineage(root)
    lock_md5 = {tag_key(MD5, p): (p, h) for p, h in lineage["md5"].items()}
    lock_params = {params_key(s): (s, params_value(p)) for s, p in lineage["params"].items()}
    artifacts, params = [], []
    with dvc_dir_hasher(root) as hash_dir:
        for key in sorted(k for k in tags if k.startswith(MD5)):
            recorded = tags[key]
            path, now = lock_md5.get(key, (key[len(MD5) :], None))
            on_disk = disk_md5(root / path, hash_dir)
            artifacts.append(
                {
                    "path": path,
                    "recorded": recorded,
                    "lock": "missing" if now is None else ("match" if now == recorded else "differs"),
                    "disk": "missing" if on_disk is None else ("match" if on_disk == recorded else "differs"),
                }
            )
    for key in sorted(k for k in tags if k.startswith(PARAMS)):
        sid, now = lock_params.get(key, (key[len(PARAMS) :].replace("/", "@"), None))
        params.append(
            {"stage": sid, "lock": "missing" if now is None else ("match" if now == tags[key] else "differs")}
        )
    recorded_commit = tags.get(COMMIT)
    commit_state = (
        None if commit is None or recorded_commit is None else ("match" if commit == recorded_commit else "differs")
    )
    ok = (
        bool(artifacts)
        and all(a["lock"] == a["disk"] == "match" for a in artifacts)
        and all(p["lock"] == "match" for p in params)
    )
    return {
        "artifacts": artifacts,
        "params": params,
        "commit": {"recorded": recorded_commit, "now": commit, "state": commit_state},
        "untracked": sorted(set(p for p, _ in lock_md5.values()) - {a["path"] for a in artifacts}),
        "matches": ok,
    }


def report(result: dict, header: list[str]) -> str:
    """The comparison as text: a header, the artifacts and params tables, a verdict."""
    lines = list(header)
    c = result["commit"]
    lines.append(f"git commit: {c['recorded']}" + (f" (workspace: {c['now']}, {c['state']})" if c["state"] else ""))
    lines.append("")
    if result["artifacts"]:
        width = max(len(a["path"]) for a in result["artifacts"])
        lines.append(f"{'artifact':<{width}}  {'recorded md5':<36}  dvc.lock  on disk")
        for a in result["artifacts"]:
            lines.append(f"{a['path']:<{width}}  {a['recorded']:<36}  {a['lock']:<8}  {a['disk']}")
    else:
        lines.append("no artifact hashes recorded (the version was registered without a dvc.lock)")
    if result["params"]:
        lines.append("")
        width = max(len(p["stage"]) for p in result["params"])
        lines.append(f"{'params of stage':<{width}}  dvc.lock")
        for p in result["params"]:
            lines.append(f"{p['stage']:<{width}}  {p['lock']}")
    if result["untracked"]:
        lines.append("")
        lines.append(f"in dvc.lock now but not in this version's lineage: {', '.join(result['untracked'])}")
    lines.append("")
    if result["matches"]:
        lines.append("workspace matches: every recorded artifact and param is what dvc.lock and the disk hold now")
    else:
        bad = [a["path"] for a in result["artifacts"] if not a["lock"] == a["disk"] == "match"]
        badp = [p["stage"] for p in result["params"] if p["lock"] != "match"]
        what = (
            ([f"{len(bad)} artifact(s) ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''})"] if bad else [])
            + ([f"params of {', '.join(badp)}"] if badp else [])
            + ([] if result["artifacts"] else ["no lineage"])
        )
        lines.append(f"workspace differs from this version: {'; '.join(what)}")
    return "\n".join(lines)
