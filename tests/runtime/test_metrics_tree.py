"""Metrics that diff: every metrics file DVC tracks lies under metrics/ where git commits it, so
`dvc metrics diff` and `crucible compare` work against a committed baseline and DVC experiments;
dvc.yaml follows pipeline.tasks and a stage under `dvc repro` refuses a stale one; a scheduled run
prints the same summary as `crucible run`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.runtime.declaration import expand
from tasks.runtime.params import render_params
from tasks.stages import dvc_yaml, specs

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TASKS = ["bbc", "rotten"]


def sh(cwd: Path, *cmd: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc


def git(cwd: Path, *args: str) -> str:
    return sh(cwd, "git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args).stdout


def write_metrics(root: Path, accuracy: float) -> None:
    """Every metrics file of every stage (as dvc.yaml declares them), small and valid JSON."""
    for spec in specs():
        for template in spec.metrics:
            for task in TASKS if spec.per_task else [None]:
                path = root / expand(template, task)
                path.parent.mkdir(parents=True, exist_ok=True)
                body = {"n": 1}
                if path.name == "curate.json":
                    body = {"eps_hat": 0.25, "ccmmd_value": 0.01}
                if path.name == "evaluate.json":
                    body = {
                        "order": TASKS,
                        "deployable": {
                            "quantized": {"accuracy": {t: accuracy for t in TASKS}, "mean_accuracy": accuracy}
                        },
                    }
                if path.name == "registered.json":
                    body = {"model": "quantized", "size_mb": {"served": 12.5}, "gate": {"decision": "champion"}}
                if path.name == "quantize.json":
                    body = {"bits_per_weight_all_in": 4.6}
                path.write_text(json.dumps(body))


def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    params = render_params(ROOT / "params.yaml", "demo")  # the demo's, whatever this project's params.yaml says
    params["pipeline"]["tasks"] = {t: params["pipeline"]["tasks"][t] for t in TASKS}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "dvc.yaml").write_text(dvc_yaml(TASKS))
    shutil.copytree(ROOT / ".dvc" / "plots", root / ".dvc" / "plots") if (ROOT / ".dvc" / "plots").is_dir() else None
    (root / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    git(root, "init", "-q")
    sh(root, str(BIN / "dvc"), "init", "-q", "--force")
    return root


def test_metrics_diff_and_compare_against_a_committed_baseline(tmp_path):
    root = project(tmp_path)
    write_metrics(root, 0.80)
    # nothing DVC tracks as a metric is git-ignored: all of it can be committed
    ignored = sh(root, "git", "status", "--porcelain", "--ignored", "metrics", check=False).stdout
    assert "!!" not in ignored, ignored
    git(root, "add", "-A")
    git(root, "commit", "-qm", "baseline")
    write_metrics(root, 0.85)
    diff = sh(root, str(BIN / "dvc"), "metrics", "diff")
    assert "failed to load" not in diff.stdout + diff.stderr
    assert "metrics/evaluate.json" in diff.stdout and "0.8" in diff.stdout and "0.85" in diff.stdout
    # an experiment's figures come from its git ref, as DVC stores it (refs/exps/<sha[:2]>/<sha[2:]>/<name>)
    head = git(root, "rev-parse", "HEAD").strip()
    write_metrics(root, 0.90)
    git(root, "add", "-A")
    tree = git(root, "write-tree").strip()
    exp = git(root, "commit-tree", tree, "-p", head, "-m", "exp").strip()
    git(root, "update-ref", f"refs/exps/{head[:2]}/{head[2:]}/lr-sweep-3", exp)
    git(root, "reset", "-q")
    write_metrics(root, 0.85)
    out = sh(root, str(BIN / "crucible"), "compare").stdout
    lines = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()[1:]}
    assert out.splitlines()[0].split() == ["workspace", "HEAD", "lr-sweep-3"], out
    assert lines["accuracy bbc"][-3:] == ["0.8500", "0.8000", "0.9000"], out
    assert lines["eps_hat rotten"][-3:] == ["0.2500"] * 3 and lines["gate"][-1] == "champion", out
    assert {"CC-MMD bbc", "served MB", "bits per weight (all in)", "mean accuracy (quantized)"} <= set(lines), out
    named = sh(root, str(BIN / "crucible"), "compare", "lr-sweep-3").stdout
    assert named.splitlines()[0].split() == ["workspace", "lr-sweep-3"]
    bad = sh(root, str(BIN / "crucible"), "compare", "no-such-rev", check=False)
    assert bad.returncode == 2 and "neither a git revision nor a DVC experiment" in bad.stderr


@pytest.mark.long
def test_dvc_yaml_follows_the_tasks_and_a_stale_one_is_refused_under_dvc(tmp_path):
    root = project(tmp_path)
    # written for other tasks: `dag check` says so, and a stage over all tasks refuses to run under dvc repro
    (root / "dvc.yaml").write_text(dvc_yaml(["bbc"]))
    check = sh(root, str(BIN / "crucible"), "dag", "check", check=False)
    assert check.returncode == 1 and "pipeline.tasks (bbc, rotten)" in check.stderr
    stage = sh(root, str(BIN / "crucible"), "stage", "merge", env={"DVC_STAGE": "merge"}, check=False)
    assert stage.returncode == 2 and "run `crucible dag write`" in stage.stderr, stage.stderr
    assert stage.stderr.count("\n") == 1
    sh(root, str(BIN / "crucible"), "dag", "write")
    assert (root / "dvc.yaml").read_text() == dvc_yaml(TASKS)
    assert sh(root, str(BIN / "crucible"), "dag", "check").returncode == 0


def test_a_scheduled_run_prints_the_summary_of_crucible_run(tmp_path, monkeypatch, capsys):
    import flows.pipeline as pipeline

    root = project(tmp_path)
    write_metrics(root, 0.5)
    evaluate = json.loads((root / "metrics" / "evaluate.json").read_text())
    evaluate["warnings"] = ["finetune@bbc: test accuracy 0.500 is at chance"]
    (root / "metrics" / "evaluate.json").write_text(json.dumps(evaluate))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pipeline"]["smoke_test"] = True
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    fake = {"model": {"seconds": 1.5}, "ingest@bbc": "skipped"}
    monkeypatch.setattr(pipeline, "run_pipeline", lambda root, stages=None: fake)
    logged = []
    monkeypatch.setattr(
        pipeline, "get_run_logger", lambda: type("L", (), {"info": lambda self, *a: logged.append(a)})()
    )
    assert pipeline.scheduled.fn(str(root)) == fake
    out = capsys.readouterr().out
    assert "  model                        ran in 1.5 s" in out and "  ingest@bbc                   up to date" in out
    assert "note: a smoke test" in out and "warning: finetune@bbc: test accuracy 0.500 is at chance" in out
    assert logged and "pipeline finished in" in logged[0][1]
