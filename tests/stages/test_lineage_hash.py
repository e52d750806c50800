"""The lineage's directory hash is DVC's own: in a small git + DVC repository, a stage's directory
output hashes to the md5 that `dvc repro` records in dvc.lock, files that .dvcignore names leave it
unchanged (as they leave `dvc status` clean), and a changed file changes it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.registry.lineage import MD5, compare, dir_md5, disk_md5, dvc_dir_hasher, tag_key
from tasks.runtime.io import md5_file

DVC = Path(sys.executable).with_name("dvc")
MAKE = (
    "mkdir -p out/sub out/deep/er && printf 'alpha\\n' > out/a.txt && printf 'beta' > out/sub/b.bin "
    "&& printf 'gamma\\n' > out/deep/er/c.csv && printf 'one file' > single.txt"
)


def _run(root: Path, *cmd: str) -> str:
    proc = subprocess.run(
        list(cmd), cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "DVC_NO_ANALYTICS": "1"}
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dvcrepo")
    _run(root, "git", "init", "-q")
    _run(root, str(DVC), "init", "-q")
    (root / ".dvcignore").write_text("*.tmp\nout/sub/cache/\n")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": {"cmd": MAKE, "outs": ["out", "single.txt"]}}}))
    _run(root, str(DVC), "repro", "-q")
    return root


def _lock(root: Path) -> dict[str, str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for o in lock["stages"]["make"]["outs"]}


def test_dir_hash_equals_dvc_lock(repo):
    lock = _lock(repo)
    assert lock["out"].endswith(".dir")
    assert dir_md5(repo / "out") == lock["out"]
    assert dir_md5(repo / "out", repo) == lock["out"]
    assert disk_md5(repo / "single.txt") == md5_file(repo / "single.txt") == lock["single.txt"]
    assert disk_md5(repo / "nothing") is None


def test_dvcignored_files_leave_the_hash_alone_and_a_change_moves_it(repo):
    lock = _lock(repo)["out"]
    (repo / "out" / "scratch.tmp").write_text("editor swap file")
    (repo / "out" / "sub" / "cache").mkdir()
    (repo / "out" / "sub" / "cache" / "x.bin").write_bytes(b"\0" * 10)
    try:
        assert "changed" not in _run(repo, str(DVC), "status", "make")  # DVC does not see them either
        with dvc_dir_hasher(repo) as hash_dir:
            assert hash_dir(repo / "out") == lock
        tags = {tag_key(MD5, "out"): lock}
        assert compare(repo, tags)["artifacts"] == [{"path": "out", "recorded": lock, "lock": "match", "disk": "match"}]
        saved = (repo / "out" / "a.txt").read_bytes()
        (repo / "out" / "a.txt").write_bytes(saved + b"!")
        try:
            assert dir_md5(repo / "out") != lock
            assert compare(repo, tags)["artifacts"][0]["disk"] == "differs"
        finally:
            (repo / "out" / "a.txt").write_bytes(saved)
        assert dir_md5(repo / "out") == lock
    finally:
        (repo / "out" / "scratch.tmp").unlink()
        shutil.rmtree(repo / "out" / "sub" / "cache")
