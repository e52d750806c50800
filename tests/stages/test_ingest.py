"""The ingest stage: determinism, the user-files path, validation that writes nothing, kills."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import yaml

from crucible.schema import DataValidationError
from tasks.runtime.io import md5_file
from tasks.stages import execute

TABLES = ("reference", "pool", "audit", "test", "truth")


def set_params(root: Path, **sections) -> None:
    data = yaml.safe_load((root / "params.yaml").read_text())
    for dotted, value in sections.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def hashes(root: Path, task: str) -> dict:
    """The task's ingest outputs by name: the tables under data/<task>/, ingest.json under metrics/<task>/."""
    files = [*sorted((root / "data" / task).glob("*")), *sorted((root / "metrics" / task).glob("ingest.json"))]
    return {p.name: md5_file(p) for p in files if p.is_file() and not p.name.startswith(".")}


def test_demo_ingest_is_deterministic_and_valid(tiny_project):
    first = execute("ingest", "trec", tiny_project)
    h1 = hashes(tiny_project, "trec")
    second = execute("ingest", "trec", tiny_project)
    assert hashes(tiny_project, "trec") == h1, "same params must give byte-identical files"
    assert first.outputs == second.outputs
    assert set(h1) == {f"{t}.parquet" for t in TABLES} | {"ingest.json"}
    base = tiny_project / "data" / "trec"
    assert not (base / "ingest.json").exists(), "the metrics file lies under metrics/<task>/, where git commits it"
    pool, audit, truth = (pd.read_parquet(base / f"{t}.parquet") for t in ("pool", "audit", "truth"))
    assert len(pool) == 120 and set(audit["id"]) <= set(pool["id"])
    merged = audit.merge(truth, on="id", suffixes=("", "_truth"))
    assert (merged["member"] == merged["member_truth"]).all(), "the annotator answers from the truth"
    metrics = json.loads((tiny_project / "metrics" / "trec" / "ingest.json").read_text())
    assert metrics["eps_true"] == pytest.approx(1 - truth["member"].mean())
    # another seed gives another draw
    set_params(tiny_project, pipeline__seed=7)
    execute("ingest", "trec", tiny_project)
    assert hashes(tiny_project, "trec")["pool.parquet"] != h1["pool.parquet"]


def _write_user_files(root: Path, task: str, audit_pi=0.5) -> Path:
    base = root / "inputs" / task
    base.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(
        {"id": ["r1", "r2", "r3"], "text": ["good film", "bad film", "fine film"], "label": ["pos", "neg", "pos"]}
    ).to_parquet(base / "reference.parquet")
    pd.DataFrame({"id": ["p1", "p2", "p3", "p4"], "text": ["great", "awful", "cookie banner", "meh"]}).to_parquet(
        base / "pool.parquet"
    )
    pd.DataFrame({"id": ["p1", "p3"], "pi": [audit_pi, 0.5], "member": [1, 0], "label": ["pos", None]}).to_parquet(
        base / "audit.parquet"
    )
    pd.DataFrame({"id": ["t1", "t2"], "text": ["lovely", "dull"], "label": ["pos", "neg"]}).to_parquet(
        base / "test.parquet"
    )
    return base


def test_user_files_are_validated_and_published(tiny_project):
    set_params(tiny_project, ingest__source="files", ingest__audit__budget=2)
    _write_user_files(tiny_project, "bbc")
    result = execute("ingest", "bbc", tiny_project)
    out = tiny_project / "data" / "bbc"
    assert pd.read_parquet(out / "pool.parquet")["id"].tolist() == ["p1", "p2", "p3", "p4"]
    assert result.metrics["n_audit"] == 2 and "eps_true" not in result.metrics


def test_bad_user_file_stops_the_stage_and_writes_nothing(tiny_project):
    set_params(tiny_project, ingest__source="files", ingest__audit__budget=2)
    _write_user_files(tiny_project, "bbc")
    execute("ingest", "bbc", tiny_project)
    before = hashes(tiny_project, "bbc")
    _write_user_files(tiny_project, "bbc", audit_pi=0.0)
    with pytest.raises(DataValidationError) as err:
        execute("ingest", "bbc", tiny_project)
    assert "inputs/bbc/audit.parquet, column 'pi', row 0: got 0.0" in str(err.value)
    assert hashes(tiny_project, "bbc") == before, "earlier outputs must stay intact"
    # the same error through the command line: exit code 2 and the message on stderr
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "stage", "ingest", "--task", "bbc", "--root", str(tiny_project)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "column 'pi', row 0: got 0.0" in proc.stderr


KILLER = textwrap.dedent("""
    import os, signal, sys
    import pandas as pd
    from tasks.stages import execute
    original, written = pd.DataFrame.to_parquet, []
    def to_parquet_then_die(self, *args, **kwargs):
        original(self, *args, **kwargs)
        written.append(args[0])
        if len(written) == 3:  # three tables written to temporary files, none published yet
            os.kill(os.getpid(), signal.SIGKILL)
    pd.DataFrame.to_parquet = to_parquet_then_die
    execute("ingest", "trec", sys.argv[1])
""")


def test_killed_ingest_leaves_previous_outputs_intact(tiny_project):
    execute("ingest", "trec", tiny_project)
    before = hashes(tiny_project, "trec")
    set_params(tiny_project, pipeline__seed=11)  # the next run would change every file
    proc = subprocess.run([sys.executable, "-c", KILLER, str(tiny_project)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert hashes(tiny_project, "trec") == before
    leftovers = list((tiny_project / "data" / "trec").glob(".*.tmp"))
    assert len(leftovers) == 3, "the killed run's temporary files, never renamed into place"
    execute("ingest", "trec", tiny_project)  # a clean rerun publishes and sweeps the leftovers
    assert hashes(tiny_project, "trec")["pool.parquet"] != before["pool.parquet"]
    assert not list((tiny_project / "data" / "trec").glob(".*.tmp"))
    assert not list((tiny_project / "metrics" / "trec").glob(".*.tmp"))
