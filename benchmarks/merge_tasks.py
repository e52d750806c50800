"""Continual merging of the demo task models: every method, several arrival orders, and time and peak
memory as the number of tasks grows to 8.

    python benchmarks/merge_tasks.py                               # 3 orders, all methods, scale to 8
    python benchmarks/merge_tasks.py --eval-limit 100 --scale 0    # quicker, no scaling part

Reads the project's data/<task>/finetune/ and test.parquet (made by the pipeline: `make run`);
writes nothing there. Uses the merge stage's own code (tasks.stages.merge, tasks.data.merge_worker: one worker
process per method
and order, the accuracy matrix with each task's head) and the methods of params.yaml `merge`.

Accuracy, per order and method: the final average accuracy, the same normalised by each task's own
fine-tune (mean_i R[T,i] / ft_i), backward transfer (mean_i R[T,i] - R[i,i], negative = forgetting),
and the accuracy of every task after each arrival. Then the means over the orders.

Scaling: the 4 task vectors are replicated to `--scale` tasks (task k = the task vector of task
k mod 4 plus seeded Gaussian noise of 10% of its norm per tensor, so that no two arrivals are
identical) and each method merges them in a fresh process; reported per method: seconds per
arrival (add + merged) and the peak RSS above theta_0 after 1, 2, 4 and 8 arrivals, and the bytes of
its state. Memory is flat when the peak after 8 equals the peak after 1 or 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tasks.data.heldout_scoring import FeatureStore, Scorer, read_task_model  # noqa: E402
from tasks.data.merge_worker import run_method  # noqa: E402
from tasks.data.models import resolve_model  # noqa: E402
from tasks.runtime.params import load_params  # noqa: E402
from tasks.stages.merge import merge_method, reference_accuracy  # noqa: E402


def default_orders(tasks: list[str]) -> list[list[str]]:
    """The given order, its reverse, and a seeded shuffle different from both (when there is one)."""
    orders = [list(tasks), list(reversed(tasks))]
    rng = np.random.default_rng(0)
    for _ in range(100):
        perm = [tasks[i] for i in rng.permutation(len(tasks))]
        if perm not in orders:
            orders.append(perm)
            break
    return orders


def accuracy_part(args, params, methods) -> None:
    tasks = list(params.pipeline.tasks)
    orders = [o.split(",") for o in args.orders.split(";")] if args.orders else default_orders(tasks)
    for order in orders:
        if sorted(order) != sorted(tasks):
            raise SystemExit(f"--orders: {order} is not a permutation of the tasks {tasks}")
    specs = {t: read_task_model(ROOT, t, params.model.name) for t in tasks}
    tests = {t: pd.read_parquet(ROOT / "data" / t / "test.parquet") for t in tasks}
    if args.eval_limit:
        tests = {t: df.head(args.eval_limit) for t, df in tests.items()}
    scorer = Scorer(resolve_model(params.model.name), list(specs.values()), tests, 64)
    store = FeatureStore(scorer)  # features stay in memory only (this script writes no stage outputs)
    base, finetuned = reference_accuracy(store, list(specs.values()))
    print("## reference accuracy (test, first %s items per task)" % (args.eval_limit or "all"))
    print(f"{'task':10s} {'n':>5s} {'base':>7s} {'own fine-tune':>14s}")
    for t in tasks:
        print(f"{t:10s} {len(tests[t]):5d} {base[t]:7.3f} {finetuned[t]:14.3f}")

    results = []
    with tempfile.TemporaryDirectory(prefix="merge-bench-") as tmp:
        tmp = Path(tmp)
        theta0 = tmp / "theta0.safetensors"
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in scorer.theta_0.items()}, str(theta0))
        for o, order in enumerate(orders):
            print(f"\n## order {o + 1}: {' -> '.join(order)}", flush=True)
            print(
                f"{'method':16s} {'avg acc':>8s} {'norm acc':>9s} {'BWT':>7s}   accuracy of each task after each "
                f"arrival (rows: after arrival j; columns: {', '.join(order)})"
            )
            for method, kwargs in methods.items():
                start = time.perf_counter()
                entry, _, _ = merge_method(
                    method,
                    kwargs or {},
                    theta0,
                    [specs[t] for t in order],
                    tmp / f"{o}-{method}",
                    store,
                    finetuned,
                    args.threads,
                )
                R = np.array(entry["R"])
                rows = " | ".join(" ".join(f"{x:.3f}" for x in R[j, : j + 1]) for j in range(len(order)))
                print(
                    f"{method:16s} {entry['avg_accuracy']:8.3f} {entry['normalised_accuracy']:9.3f} "
                    f"{entry['bwt']:+7.3f}   {rows}   [{time.perf_counter() - start:.0f}s]",
                    flush=True,
                )
                results.append(
                    {
                        "order": o,
                        "method": method,
                        **{
                            k: entry[k]
                            for k in ("avg_accuracy", "normalised_accuracy", "bwt", "merge_seconds", "peak_rss_mb")
                        },
                    }
                )
                for p in (tmp / f"{o}-{method}").glob("*.safetensors"):
                    p.unlink()
    df = pd.DataFrame(results)
    print(f"\n## mean over {len(orders)} orders (sd across orders)")
    print(f"{'method':16s} {'avg acc':>14s} {'norm acc':>14s} {'BWT':>15s} {'merge s':>8s} {'peak MB':>8s}")

    def ms(x):
        return f"{x.mean():.3f}±{x.std(ddof=1) if len(x) > 1 else 0:.3f}"

    for method, g in df.groupby("method", sort=False):
        print(
            f"{method:16s} {ms(g['avg_accuracy']):>14s} {ms(g['normalised_accuracy']):>14s} {ms(g['bwt']):>15s} "
            f"{g['merge_seconds'].mean():8.1f} {g['peak_rss_mb'].max():8.0f}"
        )
    print(
        f"{'(base model)':16s} {statistics.mean(base.values()):14.3f} "
        f"{statistics.mean(base[t] / finetuned[t] for t in tasks):14.3f}"
    )
    print(f"{'(own fine-tunes)':16s} {statistics.mean(finetuned.values()):14.3f} {1.0:14.3f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"orders": orders, "base": base, "finetuned": finetuned, "results": results}, indent=2)
        )


def scaling_part(args, params, methods) -> None:
    from safetensors.torch import load_file, save_file

    tasks = list(params.pipeline.tasks)
    from crucible.embed import load_encoder

    encoder, _ = load_encoder(resolve_model(params.model.name))
    theta_0 = {k: v.detach().clone().contiguous() for k, v in encoder.state_dict().items()}
    del encoder
    print(f"\n## scaling: {args.scale} arrivals (the {len(tasks)} task vectors replicated, +10% noise)")
    with tempfile.TemporaryDirectory(prefix="merge-scale-") as tmp:
        tmp = Path(tmp)
        theta0 = tmp / "theta0.safetensors"
        save_file(theta_0, str(theta0))
        paths = []
        g = torch.Generator().manual_seed(0)
        for k in range(args.scale):
            t = tasks[k % len(tasks)]
            theta_t = load_file(str(ROOT / "data" / t / "finetune" / "model.safetensors"))
            out = {}
            for name, w in theta_0.items():
                if not w.is_floating_point():
                    out[name] = w
                    continue
                tau = theta_t[name].float() - w
                if k >= len(tasks):
                    noise = torch.randn(tau.shape, generator=g)
                    tau = tau + 0.1 * noise * (tau.norm() / noise.norm().clamp_min(1e-12))
                out[name] = (w + tau).contiguous()
            paths.append(tmp / f"task{k}.safetensors")
            save_file(out, str(paths[-1]))
        marks = [n for n in (1, 2, 4, 8, 16) if n <= args.scale]
        head = " ".join(f"{'s@' + str(n):>7s}" for n in marks) + " " + " ".join(f"{'MB@' + str(n):>7s}" for n in marks)
        print(f"{'method':16s} {head} {'state MB':>9s}")
        for method, kwargs in methods.items():
            result = run_method(method, kwargs or {}, theta0, paths, tmp / method, "final", args.threads)
            recs = result["records"]
            secs = " ".join(f"{recs[n - 1]['add_seconds'] + recs[n - 1]['merged_seconds']:7.2f}" for n in marks)
            mem = " ".join(f"{max(r['peak_rss_mb'] for r in recs[:n]):7.0f}" for n in marks)
            print(f"{method:16s} {secs} {mem} {recs[-1]['state_mb']:9.0f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--orders",
        default="",
        help="';'-separated arrival orders, each ','-separated task names "
        "(default: params order, reversed, and one seeded shuffle)",
    )
    ap.add_argument("--methods", default="", help="comma-separated subset of params.yaml merge.methods")
    ap.add_argument("--eval-limit", type=int, default=0, help="test items per task (0 = all)")
    ap.add_argument("--scale", type=int, default=8, help="arrivals in the scaling part (0 = skip)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default="", help="also write the accuracy results to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = load_params(ROOT / "params.yaml")
    methods = dict(params.merge.methods)
    if args.methods:
        unknown = [m for m in args.methods.split(",") if m not in methods]
        if unknown:
            raise SystemExit(f"--methods: {unknown} not in params.yaml merge.methods ({', '.join(methods)})")
        methods = {m: methods[m] for m in args.methods.split(",")}
    print(f"# merge_tasks: tasks={list(params.pipeline.tasks)} methods={methods} threads={args.threads}")
    start = time.perf_counter()
    if not args.skip_accuracy:
        accuracy_part(args, params, methods)
    if args.scale:
        scaling_part(args, params, methods)
    print(f"\n# total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
