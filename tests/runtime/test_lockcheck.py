"""A stage's inputs against what their producer recorded (tasks/runtime/lockcheck.py), in a tiny DVC
project whose dvc.lock DVC itself writes: a file or a folder output that changed after its stage
ran is named with the command that rebuilds it; what the producer last wrote on its own is
accepted; without a dvc.lock entry nothing is checked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tasks.runtime import lockcheck
from tasks.runtime.declaration import files_under
from tasks.runtime.io import md5_file

DVC_YAML = {
    "stages": {
        "make": {"cmd": "true", "outs": ["out", "single.txt"]},
        "use": {"cmd": "true", "deps": ["out", "single.txt"], "outs": ["used.txt"]},
    }
}


def _dvc(root: Path, *args: str) -> None:
    exe = Path(sys.executable).with_name("dvc")
    proc = subprocess.run(
        [str(exe), *args], cwd=root, capture_output=True, text=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"}
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """`make` wrote out/ (two files) and single.txt, and DVC committed it: dvc.lock and its cache."""
    root = tmp_path_factory.mktemp("lockcheck")
    _dvc(root, "init", "--no-scm", "-q")
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    (root / "out").mkdir()
    (root / "out" / "a.bin").write_bytes(b"weights " * 1000)
    (root / "out" / "b.json").write_text('{"classes": ["x", "y"]}')
    (root / "single.txt").write_text("one\n")
    (root / "used.txt").write_text("made from them\n")
    _dvc(root, "commit", "--force", "make", "use")
    return root


def read(root: Path, *deps: str) -> dict[str, str]:
    """What the runner hands to the check: each dep's files and their md5."""
    return {p.as_posix(): md5_file(root / p) for d in deps for p in files_under(root, d)}


def edited(path: Path, data: bytes):
    """Write `data` to `path` for the block, then put the old bytes back."""

    class Edit:
        def __enter__(self):
            self.saved = path.read_bytes()
            path.write_bytes(data)

        def __exit__(self, *exc):
            path.write_bytes(self.saved)

    return Edit()


def test_dir_hash_is_what_dvc_records(committed):
    lock = lockcheck.read_lock(committed)
    want = {o["path"]: o["md5"] for o in lock["make"]["outs"]}
    files = {p.relative_to("out").as_posix(): md5_file(committed / p) for p in files_under(committed, "out")}
    assert lockcheck.dir_hash(files) == want["out"] and want["out"].endswith(".dir")
    assert md5_file(committed / "single.txt") == want["single.txt"]


def test_intact_inputs_pass(committed):
    lockcheck.check(committed, "use", read(committed, "out", "single.txt"))


def test_a_changed_file_in_a_folder_output_is_named_with_the_command_that_rebuilds_it(committed):
    path = committed / "out" / "a.bin"
    with edited(path, path.read_bytes().replace(b"weights", b"weighty", 1)):
        now = md5_file(path)
        with pytest.raises(lockcheck.StaleInput) as err:
            lockcheck.check(committed, "use", read(committed, "out", "single.txt"))
    message = str(err.value)
    assert message.startswith(f"{path}: md5 {now} is not what stage make wrote (dvc.lock records ")
    assert "rebuild it with `crucible stage make` (or `dvc repro make`)" in message and "\n" not in message


def test_without_the_cache_the_folder_is_named(committed, tmp_path):
    lock = lockcheck.read_lock(committed)
    value = next(o["md5"] for o in lock["make"]["outs"] if o["path"] == "out")
    cached = committed / ".dvc" / "cache" / "files" / "md5" / value[:2] / value[2:]
    assert cached.is_file()
    moved = tmp_path / "listing"
    cached.rename(moved)
    try:
        with edited(committed / "out" / "b.json", b'{"classes": ["x", "z"]}'):
            with pytest.raises(
                lockcheck.StaleInput, match=rf"^{committed / 'out'}: md5 \w+\.dir is not what stage make wrote"
            ):
                lockcheck.check(committed, "use", read(committed, "out"))
    finally:
        moved.rename(cached)


def test_a_changed_file_output_is_named(committed):
    with edited(committed / "single.txt", b"two\n"):
        with pytest.raises(
            lockcheck.StaleInput, match=rf"^{committed / 'single.txt'}: md5 [0-9a-f]{{32}} is not what stage make"
        ):
            lockcheck.check(committed, "use", read(committed, "out", "single.txt"))


def test_what_the_producer_last_wrote_on_its_own_is_accepted(committed):
    """`crucible stage make` rewrote its outputs without DVC: dvc.lock is behind, the producer's record
    is not."""
    path = committed / "single.txt"
    with edited(path, b"rerun\n"):
        lockcheck.record(committed, "make", {"single.txt": md5_file(path)})
        try:
            lockcheck.check(committed, "use", read(committed, "out", "single.txt"))
            # a record of another stage, or of another file, excuses nothing
            lockcheck.record(committed, "use", {"single.txt": md5_file(path)})
            lockcheck.record(committed, "make", {"out/a.bin": md5_file(committed / "out" / "a.bin")})
            with pytest.raises(lockcheck.StaleInput, match=rf"^{committed / 'single.txt'}: "):
                lockcheck.check(committed, "use", read(committed, "single.txt"))
        finally:
            for sid in ("make", "use"):
                (committed / lockcheck.RECORDS / f"{sid}.json").unlink()


def test_no_entry_means_nothing_to_check(committed, tmp_path):
    (tmp_path / "single.txt").write_text("anything\n")
    lockcheck.check(tmp_path, "use", read(tmp_path, "single.txt"))  # no dvc.lock
    # the reader's own outputs, and files no stage wrote, are not its inputs' producers' business
    with edited(committed / "used.txt", b"rewritten\n"):
        lockcheck.check(committed, "use", read(committed, "used.txt"))
        lockcheck.check(committed, "make", {"elsewhere.txt": "0" * 32})


def test_md5_is_read_again_after_a_rewrite(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 64)
    first = md5_file(path)
    path.write_bytes(b"b" * 64)  # same size, same folder
    assert md5_file(path) != first


def test_a_stage_starting_while_the_flow_commits_reads_the_whole_dvc_lock(committed, tmp_path, monkeypatch):
    # DVC rewrites dvc.lock in place: the merge8 profile's curate@sms started while the flow's `dvc
    # commit` had truncated it and stopped with "no 'stages' mapping; not a dvc.lock file". A stage
    # reads it under the guard that flows.dvc.commit holds exclusively.
    import threading

    from flows import dvc

    root = tmp_path / "project"
    root.mkdir()
    full = (committed / "dvc.lock").read_text()
    (root / "dvc.lock").write_text(full)
    truncated = threading.Event()

    def slow_commit(where, *args, **kwargs):  # DVC's write, slowed down: empty, then the whole file
        (where / "dvc.lock").write_text("")
        truncated.set()
        time.sleep(0.6 * 5)  # longer than read_lock's retries would wait without the guard
        (where / "dvc.lock").write_text(full)

    monkeypatch.setattr(dvc, "_dvc", slow_commit)
    writer = threading.Thread(target=dvc.commit, args=(root, ["make"]))
    writer.start()
    assert truncated.wait(10)
    try:
        stages = lockcheck.read_lock(root)
    finally:
        writer.join()
    assert set(stages) == {"make", "use"}
