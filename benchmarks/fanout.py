"""The per-task fan-out under each task runner, against the tasks one after another, and the
Prefect flow's overhead against `dvc repro` for the same work.

    python benchmarks/fanout.py --profile tiny                    # threads, dask, ray (if installed)
    python benchmarks/fanout.py --profile default --runners sequential,threads,dask

In a workspace of the profile (build/bench-fanout-<profile>; the upstream stages are run once,
untimed) it makes the finetune stage of every task stale (its outputs and checkpoints removed) and
times, as whole commands (what a user waits for, process start included):
- `crucible run --stage finetune` with runner threads and max_workers 1 ("sequential": the tasks
  one after another, each with every core), threads / dask / ray with max_workers 2 (two tasks
  side by side, each with cores // 2 torch threads);
- `dvc repro` of the same finetune@<task> stages (one process per stage, one after another);
- a no-op run of each (everything up to date: what a scheduled run costs when nothing changed).
Times are wall seconds; ratios are against the sequential flow of the same run. Ray needs the
`ray` extra (pip install -e '.[ray]'); runners whose integration is missing are skipped, and said.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent
UPSTREAM = ["ingest", "embed", "curate", "pseudolabel"]
RUNNERS = {"sequential": ("threads", 1), "threads": ("threads", 2), "dask": ("dask", 2), "ray": ("ray", 2)}


def sh(root: Path, *cmd: str) -> float:
    # dvc.yaml's commands call `crucible`: the project virtualenv first on PATH
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / ".prefect"),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    start = time.perf_counter()
    proc = subprocess.run(list(cmd), cwd=root, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed in {root}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return seconds


def set_runner(root: Path, runner: str, workers: int) -> None:
    path = root / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["pipeline"].update(runner=runner, max_workers=workers)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def make_stale(root: Path, tasks: list[str]) -> None:
    for t in tasks:
        shutil.rmtree(root / "data" / t / "finetune", ignore_errors=True)
        (root / "metrics" / t / "finetune.json").unlink(missing_ok=True)
    shutil.rmtree(root / ".crucible" / "checkpoints" / "finetune", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", help="tiny | default")
    ap.add_argument("--runners", default="sequential,threads,dask,ray")
    ap.add_argument("--workspace", help="default: build/bench-fanout-<profile>")
    args = ap.parse_args()

    from tasks.runtime.workspace import make_workspace

    profile = None if args.profile == "default" else args.profile
    root = make_workspace(ROOT, args.workspace or ROOT / "build" / f"bench-fanout-{args.profile}", profile)
    tasks = list(yaml.safe_load((root / "params.yaml").read_text())["pipeline"]["tasks"])
    crucible = str(BIN / "crucible")
    set_runner(root, "threads", 2)
    print(f"workspace {root}: {len(tasks)} tasks ({', '.join(tasks)}), {os.cpu_count()} cores", flush=True)
    up = sh(root, crucible, "run", *[a for s in UPSTREAM for a in ("--stage", s)])
    print(f"upstream stages ({', '.join(UPSTREAM)}): {up:.1f} s (untimed setup)", flush=True)

    rows = []
    for name in args.runners.split(","):
        runner, workers = RUNNERS[name]
        if runner != "threads" and importlib.util.find_spec(f"prefect_{runner}") is None:
            print(f"{name}: skipped (prefect-{runner} is not installed: pip install -e '.[{runner}]')", flush=True)
            continue
        set_runner(root, runner, workers)
        make_stale(root, tasks)
        work = sh(root, crucible, "run", "--stage", "finetune")
        noop = sh(root, crucible, "run", "--stage", "finetune")
        rows.append((f"flow, {name} ({workers} worker{'s' if workers > 1 else ''})", work, noop))
        print(f"{rows[-1][0]}: fan-out {work:.1f} s, no-op {noop:.1f} s", flush=True)
    set_runner(root, "threads", 2)
    make_stale(root, tasks)
    targets = [f"finetune@{t}" for t in tasks]
    # --force: DVC's run cache would otherwise restore the deleted outputs instead of running
    work = sh(root, str(BIN / "dvc"), "repro", "--force", "--single-item", *targets)
    noop = sh(root, str(BIN / "dvc"), "repro", "--single-item", *targets)
    rows.append(("dvc repro (one process per stage)", work, noop))
    print(f"{rows[-1][0]}: {work:.1f} s, no-op {noop:.1f} s", flush=True)

    base = next((w for n, w, _ in rows if "sequential" in n), rows[0][1])
    print(f"\nfinetune fan-out, profile {args.profile}: {len(tasks)} tasks, {os.cpu_count()} cores")
    print(f"{'run':44s} {'wall s':>8s} {'x sequential':>13s} {'no-op s':>8s}")
    for name, work, noop in rows:
        print(f"{name:44s} {work:8.1f} {work / base:13.2f} {noop:8.1f}")


if __name__ == "__main__":
    main()
