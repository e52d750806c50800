"""Each shared piece is written once, in the layer below its users: the stage output paths
(tasks/runtime/paths.py), the strict-JSON conversion (inside AtomicOutputs), the rebuild hint of a
reader's error, the stage timer, and the public write lock. A second copy fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = [p for d in ("tasks", "flows") for p in (ROOT / d).rglob("*.py")]


def occurrences(pattern: str, exclude: str | None = None) -> list[str]:
    rx = re.compile(pattern)
    return [
        f"{p.relative_to(ROOT)}:{i}"
        for p in CODE
        if str(p.relative_to(ROOT)) != exclude
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]


def test_stage_output_paths_are_declared_once():
    assert not occurrences(r'Path\("(models|metrics|reports)"\)', exclude="tasks/runtime/paths.py")


def test_one_json_safe_inside_atomic_outputs():
    defs = occurrences(r"^def _?json_safe\(")
    assert len(defs) == 1 and defs[0].startswith("tasks/runtime/io.py"), defs


def test_one_rebuild_hint():
    hints = occurrences(r"rebuild it with `crucible stage")
    assert hints and all(h.startswith("tasks/runtime/io.py") for h in hints), hints


def test_no_stage_times_itself_by_hand():
    assert not [o for o in occurrences(r"perf_counter\(") if o.startswith("tasks/stages/")]


def test_the_write_lock_is_public_and_single():
    assert not occurrences(r"\b_WRITE_LOCK\b")
    locks = occurrences(r"^WRITE_LOCK = ")
    assert len(locks) == 1 and locks[0].startswith("tasks/runtime/tracking.py"), locks


def test_the_environment_defaults_are_written_once():
    from tasks.runtime.env import DEFAULTS

    for path in (ROOT / "Makefile", ROOT / "tests" / "conftest.py", ROOT / "flows" / "cli.py"):
        text = path.read_text()
        assert not [k for k in DEFAULTS if k in text], f"{path.name} repeats tasks/runtime/env.py's defaults"
