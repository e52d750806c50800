"""The pipeline's first promise: the same params give the same artifacts. The tiny profile (two
tasks, two merge methods, to keep the suite's time) run under the Prefect flow on threads (the two
tasks' stages in parallel threads), under the flow on a Dask LocalCluster of two worker processes
(pipeline.runner: dask) and under `dvc repro` (one process per stage) gives byte-identical outputs
for every stage, at one torch thread count (CRUCIBLE_THREADS: thread counts change floating-point
reduction order, see crucible/train.py)."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.determinism]


def _outs(root: Path) -> dict[str, str]:
    """path -> md5 of every output dvc.lock records (DVC's own hashes: folders as .dir)."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    out = {}
    for stage, spec in lock["stages"].items():
        if stage == "register":  # its record holds the MLflow run id and version: a registry fact, not a model
            continue
        for o in spec.get("outs", []):
            out[o["path"]] = o["md5"]
    return out


def _start(root: Path, *cmds: list[str]) -> tuple[subprocess.Popen, Path]:
    """The commands one after another in `root`, in the background (one torch thread each), their
    output to a file (not a pipe: no run waits on a reader)."""
    env = {**os.environ, "CRUCIBLE_THREADS": "1", "PREFECT_HOME": str(root / ".prefect")}
    log = root.with_suffix(".log")
    script = " && ".join(shlex.join(c) for c in cmds)
    with open(log, "w") as f:
        proc = subprocess.Popen(["sh", "-c", script], cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def _wait(runs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """Every run to its end (none is left running when one fails), then each must have passed."""
    for proc, _ in runs.values():
        proc.wait()
    for name, (proc, log) in runs.items():
        assert proc.returncode == 0, f"{name} failed:\n{log.read_text()[-6000:]}"


def test_threads_dask_and_dvc_repro_give_byte_identical_artifacts(tmp_path, project_root):
    pytest.importorskip("prefect_dask", reason="the Dask runner needs prefect-dask (requirements/test.txt)")
    from tasks.runtime.workspace import make_workspace

    first = make_workspace(project_root, tmp_path / "flow1", "tiny")
    params = yaml.safe_load((first / "params.yaml").read_text())
    params["pipeline"]["tasks"] = {k: params["pipeline"]["tasks"][k] for k in ("bbc", "rotten")}
    params["merge"]["methods"] = {k: params["merge"]["methods"][k] for k in ("gs3r", "task_arithmetic")}
    text = yaml.safe_dump(params, sort_keys=False)
    roots = {"flow1": first, "flow2": tmp_path / "flow2", "dvc": tmp_path / "dvc"}
    for name, root in roots.items():
        if name != "flow1":
            make_workspace(project_root, root, "tiny")
        (root / "params.yaml").write_text(text)
    dask = yaml.safe_load(text)
    dask["pipeline"].update(runner="dask", max_workers=2)
    (roots["flow2"] / "params.yaml").write_text(yaml.safe_dump(dask, sort_keys=False))
    # the three runs side by side (each in its own workspace, one torch thread each: the machine's
    # cores are shared, not the runs' state); dvc.yaml lists each task's files for the stages over all
    # tasks: rewrite it for these tasks before plain `dvc repro` (`crucible run` does so itself)
    _wait(
        {
            "the flow on threads": _start(roots["flow1"], [str(BIN / "crucible"), "run"]),
            "the flow on Dask": _start(roots["flow2"], [str(BIN / "crucible"), "run"]),
            "dvc repro": _start(
                roots["dvc"],
                [str(BIN / "crucible"), "dag", "write", "--root", str(roots["dvc"])],
                [str(BIN / "dvc"), "repro"],
            ),
        }
    )
    hashes = {name: _outs(root) for name, root in roots.items()}
    assert len(hashes["flow1"]) >= 20  # every stage's outputs for both tasks
    print(f"\n{'output':58s} {'flow threads':>12s} {'flow dask':>12s} {'dvc repro':>12s}")
    for path, h in sorted(hashes["flow1"].items()):
        print(
            f"{path:58s} {h[:12]:>12s} {hashes['flow2'].get(path, '-')[:12]:>12s} "
            f"{hashes['dvc'].get(path, '-')[:12]:>12s}"
        )
    for name in ("flow2", "dvc"):
        differ = {p: (h, hashes[name].get(p)) for p, h in hashes["flow1"].items() if hashes[name].get(p) != h}
        assert not differ, f"{name} differs from the flow on threads: {differ}"
    shutil.rmtree(tmp_path, ignore_errors=True)
