"""The sweep that chose the value defaults (docs/results.md): the teacher, the pseudo-label selection,
the fine-tune's learning rate, epochs and head initialisation, each scored on DEV rows that no stage
sees and that are not the test split.

    python benchmarks/value_sweep.py                                  # the default grid, params.yaml's tasks
    python benchmarks/value_sweep.py --tasks rotten,trec --grid teacher=probe,finetune finetune.lr=5e-5,1e-4

Per task: a scratch workspace with params.yaml's settings and that one task runs the real stages
ingest, embed and curate once; the sweep's dev rows are `--dev-rows` texts of the task's corpus drawn
(seeded) from those that ingest did not use (not in the reference, the pool or the test split). Then
for every point of the grid (the product of the `--grid` axes, each `key=v1,v2` over params.yaml
keys) the real pseudolabel and finetune stages run, and the fine-tuned model (encoder and head) is
scored on the dev rows, beside the frozen-base probe fitted on the reference (C by cross-validation):
accuracy with its 95 % paired-bootstrap interval of the difference to the probe. Nothing here reads
a test split. Prints one row per task and point, and the mean over tasks per point.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from crucible.heads import fit_probe_cv  # noqa: E402
from crucible.stats import compare_paired  # noqa: E402
from tasks.data.corpora import load_corpus  # noqa: E402
from tasks.runtime.params import deep_merge, load_params  # noqa: E402

DEFAULT_GRID = [
    "pseudolabel.teacher=probe,finetune",
    "pseudolabel.target_accuracy=0.9,1.0",
    "finetune.lr=5e-5,1e-4",
    "finetune.epochs=1,2",
]


def nested(key: str, value) -> dict:
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def parse_value(text: str):
    """A grid value: a number where it reads as one (YAML reads 5e-5 as a string), else YAML."""
    try:
        number = float(text)
    except ValueError:
        return yaml.safe_load(text)
    return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number


def grid(axes: list[str]) -> list[dict]:
    keys, values = [], []
    for axis in axes:
        key, _, vals = axis.partition("=")
        keys.append(key)
        values.append([parse_value(v) for v in vals.split(",")])
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def dev_rows(root: Path, task: str, corpus: str, n: int, seed: int) -> pd.DataFrame:
    """n texts of the corpus that ingest did not use for this task (seeded)."""
    used = set()
    for table in ("reference", "pool", "test"):
        used |= set(pd.read_parquet(root / "data" / task / f"{table}.parquet")["text"])
    df = load_corpus(corpus)
    df = df[~df["text"].isin(used) & (df["text"].str.len() >= 30)]
    return df.sample(n=min(n, len(df)), random_state=seed).reset_index(drop=True)


def score_finetune(root: Path, params, task: str, dev: pd.DataFrame) -> np.ndarray:
    """Row outcomes of the task's fine-tune (data/<task>/finetune) on the dev rows."""
    from tasks.data.heldout_scoring import Scorer, read_task_model
    from tasks.data.models import base_model

    base = base_model(params, root)
    spec = read_task_model(root, task, base.name, base.hash)
    scorer = Scorer(base, [spec], {task: dev[["id", "text", "label"]]}, 64, keep_theta_0=False)
    from tasks.runtime.io import read_safetensors

    state, _ = read_safetensors(spec["model"], "fine-tune", "rerun the sweep")
    scorer.load(state)
    return (scorer.logits(task).argmax(1) == scorer.labels(task)).numpy()


def probe_outcomes(root: Path, params, task: str, dev: pd.DataFrame) -> np.ndarray:
    """Row outcomes on the dev rows of the frozen-base probe fitted on every reference row."""
    from crucible.embed import embed_texts
    from tasks.data.models import base_model

    base = base_model(params, root)
    model, tok = base.load()
    ref = pd.read_parquet(root / "data" / task / "reference.parquet")
    x = (
        embed_texts(
            model,
            tok,
            ref["text"].tolist() + dev["text"].tolist(),
            max_length=params.embed.max_length,
            pooling=base.pooling(model.config),
        )
        .double()
        .numpy()
    )
    fit = fit_probe_cv(x[: len(ref)], ref["label"].to_numpy(dtype=object), seed=params.pipeline.seed)
    return fit.probe.predict(x[len(ref) :]) == dev["label"].to_numpy(dtype=object)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", help="tasks of params.yaml (default: all)")
    ap.add_argument("--grid", nargs="*", default=DEFAULT_GRID, help="axes key=v1,v2 over params.yaml keys")
    ap.add_argument("--dev-rows", type=int, default=400, help="dev rows per task drawn outside ingest's tables")
    ap.add_argument("--profile", default=None, help="a profile over params.yaml (e.g. tiny for a smoke run)")
    ap.add_argument("--seed", type=int, default=1234, help="the dev rows' draw (not the pipeline seed)")
    ap.add_argument("--keep", help="keep the scratch workspaces under this folder")
    args = ap.parse_args(argv)

    from tasks.runtime.workspace import make_workspace
    from tasks.stages import execute

    project = load_params(ROOT / "params.yaml")
    tasks = args.tasks.split(",") if args.tasks else list(project.pipeline.tasks)
    points = grid(args.grid)
    print(f"# {len(points)} points x {len(tasks)} tasks; dev rows: {args.dev_rows} per task, outside ingest's tables")
    rows = []
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="value-sweep-"))
    for task in tasks:
        spec = project.pipeline.tasks[task]
        # every task stays in params (the demo mixes the other tasks' corpora into this one's pool); the
        # stages run for this task only
        root = make_workspace(ROOT, scratch / task, args.profile)
        data = yaml.safe_load((root / "params.yaml").read_text())
        base_params = dict(data)
        for stage in ("model", "ingest", "embed", "curate"):
            execute(stage, None if stage == "model" else task, root)
        params = load_params(root / "params.yaml")
        dev = dev_rows(root, task, spec.corpus, args.dev_rows, args.seed)
        dev["id"] = [f"sweep-dev-{i}" for i in range(len(dev))]
        probe = probe_outcomes(root, params, task, dev)
        print(f"{task}: {len(dev)} dev rows; frozen-base probe {probe.mean():.3f}", flush=True)
        for point in points:
            merged = base_params
            for key, value in point.items():
                merged = deep_merge(merged, nested(key, value))
            (root / "params.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
            start = time.perf_counter()
            execute("pseudolabel", task, root)
            execute("finetune", task, root)
            seconds = time.perf_counter() - start
            ours = score_finetune(root, load_params(root / "params.yaml"), task, dev)
            cmp = compare_paired(ours, probe, seed=args.seed)
            label = " ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
            rows.append(
                {
                    "task": task,
                    "point": label,
                    "dev_acc": cmp.a,
                    "probe": cmp.b,
                    "diff": cmp.diff,
                    "ci_low": cmp.ci_low,
                    "ci_high": cmp.ci_high,
                    "seconds": seconds,
                }
            )
            print(
                f"  {label:60s} dev {cmp.a:.3f}  vs probe {cmp.diff:+.3f} [{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}]"
                f"  {seconds:5.0f} s",
                flush=True,
            )
    df = pd.DataFrame(rows)
    print("\n## mean over tasks per point (dev accuracy, difference to the probe, seconds of pseudolabel + finetune)")
    summary = df.groupby("point", sort=False).agg(
        dev_acc=("dev_acc", "mean"), diff=("diff", "mean"), seconds=("seconds", "sum")
    )
    print(summary.sort_values("dev_acc", ascending=False).to_string(float_format=lambda x: f"{x:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
