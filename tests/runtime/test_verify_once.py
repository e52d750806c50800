"""register loads the pyfunc it is about to log in a fresh process once per content: the same bytes,
code and example rows that loaded before in this workspace are not loaded again; any changed byte
(a truncated weight file, another code file) is."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tasks.registry import verify


def saved(root: Path) -> tuple[Path, Path]:
    """A stage folder and the pyfunc folder made from it (what log_pyfunc's save step leaves)."""
    source = root / "models" / "quantize"
    source.mkdir(parents=True)
    folder = root / "pyfunc"
    packed = verify.packed_dir(folder)
    packed.mkdir(parents=True)
    for name in verify.PACKED:
        (source / name).write_bytes(b"weights of " + name.encode())
        (packed / name).write_bytes(b"weights of " + name.encode())
    (folder / "code").mkdir()
    (folder / "code" / "pyfunc.py").write_text("VERSION = 1\n")
    (folder / "MLmodel").write_text("flavors: {}\nmodel_uuid: a\nutc_time_created: '2026-12-07'\n")
    return source, folder


def test_the_same_content_is_loaded_once_and_a_changed_byte_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(verify, "load_in_fresh_process", lambda folder, example: calls.append(folder))
    source, folder = saved(tmp_path)
    example = pd.DataFrame({"text": ["a text"], "task": ["bbc"]})
    verify.verify_pyfunc(tmp_path, folder, source, "quantize", example)
    assert len(calls) == 1
    # saved again: a new id and time in MLmodel, nothing else
    (folder / "MLmodel").write_text("flavors: {}\nmodel_uuid: b\nutc_time_created: '2026-12-08'\n")
    verify.verify_pyfunc(tmp_path, folder, source, "quantize", example)
    assert len(calls) == 1
    for change in (
        lambda: (verify.packed_dir(folder) / "model.safetensors").write_bytes(b"weights of model.safe"),
        lambda: (folder / "code" / "pyfunc.py").write_text("VERSION = 2\n"),
        lambda: (folder / "MLmodel").write_text("flavors: {python_function: {}}\nmodel_uuid: b\n"),
    ):
        change()
        verify.verify_pyfunc(tmp_path, folder, source, "quantize", example)
    assert len(calls) == 4
    verify.verify_pyfunc(tmp_path, folder, source, "quantize", example.assign(text=["another text"]))
    assert len(calls) == 5


def test_a_failed_load_is_not_remembered(tmp_path, monkeypatch):
    calls = []

    def fails(folder, example):
        calls.append(folder)
        return "it does not load"

    monkeypatch.setattr(verify, "load_in_fresh_process", fails)
    source, folder = saved(tmp_path)
    example = pd.DataFrame({"text": ["a text"], "task": ["bbc"]})
    for _ in range(2):
        try:
            verify.verify_pyfunc(tmp_path, folder, source, "quantize", example)
        except ValueError as exc:
            assert "it does not load" in str(exc)
        else:
            raise AssertionError("a model that does not load was accepted")
    assert len(calls) == 2
