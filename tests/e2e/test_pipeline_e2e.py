"""End to end on the tiny profile: dvc repro and the Prefect flow run the same stages and agree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.stages import NAMES as STAGES
from tasks.stages import spec

BIN = Path(sys.executable).parent
PER_TASK = {s for s in STAGES if spec(s).per_task}
ONCE = [s for s in STAGES if s not in PER_TASK]  # stages over all tasks (merge)


TASK_FREE = {"model", "moe_build", "moe_quantize"}  # the base model and the MoE branch read no task's data


def ids(task: str) -> set[str]:
    """Stage ids a change to one task reruns: its per-task stages and every all-task stage that
    reads the tasks' data."""
    return {f"{s}@{task}" for s in STAGES if s in PER_TASK} | (set(ONCE) - TASK_FREE)


# slow (7 minutes): in `make test-long` with the determinism checks it shares the tiny profile with
pytestmark = [pytest.mark.slow, pytest.mark.determinism]


def sh(root: Path, *cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # one thread count for dvc repro and the flow, so that a rerun stage gives the same bytes under
    # either (torch and BLAS sums round by thread count; docs/stages.md, finetune, says so)
    proc = subprocess.run(
        list(cmd),
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "PREFECT_HOME": str(root / ".prefect"), "CRUCIBLE_THREADS": "1", **(env or {})},
    )
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def dvc(root: Path, *args: str) -> str:
    return sh(root, str(BIN / "dvc"), *args).stdout


def test_dvc_repro_then_flow_then_dvc_agree(tiny_project):
    root = tiny_project
    # two tasks are enough to show per-task fan-out and selective reruns, at half the time
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["pipeline"]["tasks"] = {k: data["pipeline"]["tasks"][k] for k in ("bbc", "trec")}
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    # dvc.yaml lists each task's files for the stages over all tasks: rewrite it for these tasks
    # (`crucible run` does so itself; under plain `dvc repro` a stale one is refused)
    sh(root, str(BIN / "crucible"), "dag", "write", "--root", str(root))
    out = dvc(root, "repro")
    for sid in ids("bbc"):
        assert f"Running stage '{sid}'" in out
    # the evaluate report holds every variant and interface; DVC lists the metrics and renders the plots
    variants = json.loads((root / "metrics" / "variants.json").read_text())
    assert {"base", "finetune:bbc", "finetune:trec", "gs3r@0", "gs3r@1", "quantize:mxfp4_load_aware"} <= set(variants)
    html = (root / "reports" / "index.html").read_text()
    for name in [*variants, "head", "probe", "kmeans", "agglomerative"]:
        assert name in html, name
    shown = dvc(root, "metrics", "show")
    assert "metrics/evaluate.json" in shown and "metrics/variants.json" in shown
    assert "metrics/bbc/curate.json" in shown and "metrics/merge.json" in shown  # every stage's metrics, in metrics/
    dvc(root, "plots", "show", "-o", str(root / "plots_html"))
    rendered = (root / "plots_html" / "index.html").read_text()
    assert "ACC per method and interface" in rendered and "reports/figures/interfaces.png" in rendered
    again = dvc(root, "repro")
    assert "Running stage" not in again and "Data and pipelines are up to date" in again
    assert "up to date" in dvc(root, "status")

    # a report-only change (the CC-MMD interval's level: curate.json and curate.png change, the kept
    # items do not) reruns curate and the report, never merge or quantize: every stage over all tasks
    # depends on exactly the files it reads, not on the data/ folder
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["curate"]["level"] = 0.9
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    out = dvc(root, "repro")
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"curate@bbc", "curate@trec", "evaluate"}, out

    # one param of one task changes: the Prefect flow reruns exactly that stage and dvc-commits it
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["pipeline"]["tasks"]["trec"]["n_test"] = 30
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert "ingest@trec" in dvc(root, "status")
    flow = sh(root, str(BIN / "crucible"), "run").stdout
    lines = {
        line.split()[0]: line
        for line in flow.splitlines()
        if line.startswith("  ") and ("@" in line or line.split()[0] in ONCE)
    }
    rerun = {sid for sid, line in lines.items() if "ran in" in line}
    # ingest@bbc reads every task's spec (the demo mixes the other tasks' corpora into its pool), so
    # it reruns too; its outputs are the same bytes, so nothing downstream of it does
    # and the model stage re-hashes the base model's files on every flow run (cheap; same bytes)
    assert rerun == ids("trec") | {"ingest@bbc", "model"}, flow
    assert all("up to date" in line for sid, line in lines.items() if sid not in rerun), flow
    assert len(lines) == len(STAGES) * 2 - len(ONCE)
    assert "Data and pipelines are up to date" in dvc(root, "status")
    assert "Running stage" not in dvc(root, "repro")
    # an option of a method that is not chosen (mixout's p under method gmixout) reruns nothing
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["finetune"]["mixout"]["p"] = 0.1
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert "Data and pipelines are up to date" in dvc(root, "status")

    # MLflow: one parent run for the flow, a child per stage it ran
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("crucible")
    assert exp.artifact_location.startswith((root / "mlartifacts").as_uri())
    parents = client.search_runs([exp.experiment_id], "tags.`crucible.kind` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(ids("trec") | {"ingest@bbc", "model"})
    child = next(r for r in children if r.info.run_name == "ingest@trec")
    assert child.data.metrics["n_test"] == 30
    assert child.data.tags["crucible.output.data/trec/pool.parquet"]
    assert not (root / "mlruns").exists()
    # the evaluate report went to the pipeline's parent run too
    assert "report/index.html" in [f.path for f in client.list_artifacts(parents[0].info.run_id, "report")]
