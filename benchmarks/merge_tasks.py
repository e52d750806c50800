"""Continual merging of a workspace's task models: every method of `merge.methods` on the same
fine-tunes, over several arrival orders, with the table the continual-merging literature prints.

    crucible run --profile merge8                                   # 8 real tasks, fine-tuned once
    python benchmarks/merge_tasks.py --root build/merge8 --orders 3 --json merge8.json --plot merge8.png
    python benchmarks/merge_tasks.py --root build/merge8 --sweep    # GS3R's energy x rank budget, on dev rows

Reads <root>/params.yaml, <root>/data/<task>/finetune/ and test.parquet (the pipeline's cached
fine-tunes; `--root .` is the default profile's workspace) and writes nothing there. Uses the merge
stage's own code (tasks.stages.merge.merge_method: one fresh worker process per method and order,
its seconds and peak RSS its own; each arrival's merged model scored with each task's own head).

Methods: the workspace's merge.methods (`--methods` a subset; `--kwargs gs3r='{"energy": 0.9}'`
replaces one method's options).

Orders: the workspace's arrival order, its reverse, then seeded shuffles (seed 0), `--orders` in all;
or exactly the ones given by `--order-list`.

Per method, mean and sample standard deviation over the orders ("spread") of:
- final average accuracy: the last arrival's merged model on every test row of every task;
- normalised accuracy: the same, task by task divided by the task's own fine-tune, averaged;
- BWT (backward transfer, Lopez-Paz & Ranzato 2017): mean_i R[T, i] - R[i, i] over the arrived
  tasks' first `--eval-limit` test rows (the accuracy matrix R; negative = forgetting);
- seconds per arrival (add + merged) at arrivals 1, 4 and 8, and the peak RSS over theta_0 within
  the first 1, 4 and 8 arrivals (the worker's own, sampled every 5 ms), and the bytes of its state.
Then GS3R against OPCM: per order the difference of final average accuracy with its 95% paired
bootstrap interval (rows resampled within each task), and the spread of each over orders. `--plot`
draws the accuracy after each arrival normalised by the fine-tunes (mean over the arrived tasks;
mean over orders, band +- one sd) per method.

Sweep (`--sweep`): GS3R's energy and rank budget (and `--scales`) over the workspace's order, each
final merged model scored on the reference's dev rows (labeled.parquet split == dev, never trained
on, never the test split); the ranks it holds per matrix and how full the budget is. Choose there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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

from crucible.stats import compare_tasks  # noqa: E402
from tasks.data.head_refit import dev_ids  # noqa: E402
from tasks.data.heldout_scoring import FeatureStore, Scorer, read_task_model  # noqa: E402
from tasks.data.merge_worker import run_method  # noqa: E402
from tasks.data.models import base_model  # noqa: E402
from tasks.runtime.io import read_table  # noqa: E402
from tasks.runtime.params import load_params  # noqa: E402
from tasks.stages.merge import merge_method  # noqa: E402

MARKS = (1, 4, 8)


def default_orders(tasks: list[str], n: int, seed: int = 0) -> list[list[str]]:
    """The given order, its reverse, then distinct seeded shuffles, `n` in all (fewer when the tasks
    have fewer distinct orders)."""
    orders = [list(tasks), list(reversed(tasks))][:n]
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        if len(orders) >= n:
            break
        perm = [tasks[i] for i in rng.permutation(len(tasks))]
        if perm not in orders:
            orders.append(perm)
    return orders


def workspace(root: Path, frames: str):
    """(params, task specs, a Scorer on the chosen rows, its base model): frames "test" scores the
    test split, "dev" the reference's dev rows (labeled.parquet split == dev) as its test split."""
    params = load_params(root / "params.yaml")
    tasks = params.merge_order()
    base = base_model(params, root)
    specs = {t: read_task_model(root, t, base.name, base.hash) for t in tasks}
    if frames == "test":
        rows = {t: read_table(root / "data" / t / "test.parquet", "test") for t in tasks}
    else:
        dev = dev_ids(root, tasks)
        rows = {}
        for t in tasks:
            ref = read_table(root / "data" / t / "reference.parquet", "reference")
            rows[t] = ref[ref["id"].isin(dev[t])].reset_index(drop=True)
    scorer = Scorer(base, list(specs.values()), rows, params.merge.eval_batch_size)
    return params, specs, scorer


def outcomes(store: FeatureStore, name: str, task: str) -> np.ndarray:
    """(n,) bool: the variant's head right or wrong on each of the task's test rows it was scored on."""
    x = store.tensors[f"{name}/{task}/test"]
    y = store.tensors[f"labels/{task}/test"][: len(x)]
    return (store.scorer.head_logits(task, x).argmax(1) == y).numpy()


def reference(store: FeatureStore, specs: dict, limit: int | None) -> tuple[dict, dict, dict]:
    """(base encoder, own fine-tune on every test row, own fine-tune on the first `limit`) accuracy per
    task, each task's fine-tune scored on its own task only (the stage also scores it on the tasks
    before it, for evaluate; nothing here needs that)."""
    from tasks.runtime.io import read_safetensors

    tasks = list(specs)
    store.add("base", "base", "base", -1, tasks, state=store.scorer.theta_0)
    for j, t in enumerate(tasks):
        state, _ = read_safetensors(specs[t]["model"], f"fine-tune of {t}")
        store.add(f"finetune:{t}", "finetune", "finetune", j, [t], state=state)
    base = {t: store.accuracy("base", t) for t in tasks}
    return (
        base,
        {t: store.accuracy(f"finetune:{t}", t) for t in tasks},
        {t: store.accuracy(f"finetune:{t}", t, limit) for t in tasks},
    )


def accuracy_part(args, root: Path) -> dict:
    params, specs, scorer = workspace(root, "test")
    tasks = list(specs)
    methods = pick_methods(params, args.methods, args.kwargs)
    if args.order_list:
        orders = [o.split(",") for o in args.order_list.split(";")]
        for order in orders:
            if sorted(order) != sorted(tasks):
                raise SystemExit(f"--order-list: {order} is not a permutation of the tasks {tasks}")
    else:
        orders = default_orders(tasks, args.orders)
    store = FeatureStore(scorer)  # features stay in memory (this script writes no stage outputs)
    base, finetuned, ft_limit = reference(store, specs, args.eval_limit or None)
    n_test = {t: len(scorer.labels(t)) for t in tasks}
    print("## tasks, test rows, base encoder with each fine-tune's head, own fine-tune (all test rows)")
    for t in tasks:
        print(f"{t:10s} {n_test[t]:5d} {base[t]:7.3f} {finetuned[t]:7.3f}")
    print(f"{'mean':10s} {'':5s} {np.mean(list(base.values())):7.3f} {np.mean(list(finetuned.values())):7.3f}")

    results, curves, outs = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="merge-bench-") as tmp:
        tmp = Path(tmp)
        from safetensors.torch import save_file

        theta0 = tmp / "theta0.safetensors"
        save_file({k: v.contiguous() for k, v in scorer.theta_0.items()}, str(theta0))
        for o, order in enumerate(orders):
            print(f"\n## order {o + 1}/{len(orders)}: {' -> '.join(order)}", flush=True)
            for method, kwargs in methods.items():
                start = time.perf_counter()
                entry, _, _ = merge_method(
                    method,
                    kwargs or {},
                    theta0,
                    [specs[t] for t in order],
                    tmp / f"{o}-{method}",
                    store,
                    ft_limit,
                    args.threads,
                    limit=args.eval_limit or None,
                    full_last=True,
                )
                last = f"{method}@{len(order) - 1}"
                final = {t: store.accuracy(last, t) for t in order}
                outs[o, method] = {t: outcomes(store, last, t) for t in tasks}
                secs = [a + m for a, m in zip(entry["add_seconds"], entry["merged_seconds"])]
                rec = {
                    "order": o,
                    "method": method,
                    "final_accuracy": float(np.mean(list(final.values()))),
                    "normalised_accuracy": float(np.mean([final[t] / finetuned[t] for t in order])),
                    "bwt": entry["bwt"],
                    "per_task": final,
                    "curve": entry["accuracy_curve"],
                    "normalised_curve": [
                        float(np.mean([entry["R"][j][i] / ft_limit[order[i]] for i in range(j + 1)]))
                        for j in range(len(order))
                    ],
                    "seconds_by_arrival": secs,
                    "peak_rss_mb_by_arrival": entry["peak_rss_mb_by_arrival"],
                    "state_mb": entry["state_mb"],
                    "rank_mean": entry.get("rank_mean"),
                    "budget_share_by_arrival": entry.get("budget_share_by_arrival"),
                }
                results.append(rec)
                curves[o, method] = entry["accuracy_curve"]
                print(
                    f"{method:16s} final {rec['final_accuracy']:.3f}  norm {rec['normalised_accuracy']:.3f}  "
                    f"BWT {rec['bwt']:+.3f}  s/arrival {np.mean(secs):.2f}  "
                    f"peak {max(entry['peak_rss_mb_by_arrival']):.0f} MB"
                    f"  [{time.perf_counter() - start:.0f}s]",
                    flush=True,
                )
                for p in (tmp / f"{o}-{method}").glob("*.safetensors"):
                    p.unlink()
    df = pd.DataFrame(results)
    table = summary_table(df, len(tasks))
    print(
        f"\n## mean ± sd over {len(orders)} orders ({len(tasks)} tasks, every test row for final and normalised "
        f"accuracy, the first {args.eval_limit or 'all'} per task for BWT)"
    )
    print(table)
    for method, g in df.groupby("method", sort=False):
        shares = [x for x in g["budget_share_by_arrival"] if x]
        if shares:
            print(
                f"\n{method}: share of each matrix's rank budget held after the last arrival, by arrival "
                f"position (1st .. {len(tasks)}th, mean over orders and matrices): "
                + " ".join(f"{v:.2f}" for v in np.mean(shares, 0))
                + f"; held in all {np.sum(np.mean(shares, 0)):.2f}"
            )
    verdict = versus(outs, df, orders, tasks, "gs3r", "opcm")
    print(verdict["text"])
    out = {
        "root": str(root),
        "tasks": tasks,
        "orders": orders,
        "test_rows": n_test,
        "base": base,
        "finetuned": finetuned,
        "results": results,
        "table": table,
        "verdict": verdict,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    if args.plot:
        plot_curves(results, list(methods), tasks, args.plot)
    return out


def ms(x) -> str:
    x = np.asarray(x, dtype=float)
    return f"{x.mean():.3f} ± {x.std(ddof=1) if len(x) > 1 else 0.0:.3f}"


def summary_table(df: pd.DataFrame, n_tasks: int) -> str:
    """Markdown: per method mean ± sd over orders of the accuracies, and the time and memory marks."""
    marks = [n for n in MARKS if n <= n_tasks]
    head = (
        "| method | final avg accuracy | normalised accuracy | BWT | "
        + " | ".join(f"s/arrival @{n}" for n in marks)
        + " | "
        + " | ".join(f"peak MB ≤{n}" for n in marks)
        + " | state MB |"
    )
    lines = [head, "|" + "---|" * (5 + 2 * len(marks))]
    for method, g in df.groupby("method", sort=False):
        secs = [ms([s[n - 1] for s in g["seconds_by_arrival"]]) for n in marks]
        mem = [f"{np.mean([max(p[:n]) for p in g['peak_rss_mb_by_arrival']]):.0f}" for n in marks]
        lines.append(
            f"| {method} | {ms(g['final_accuracy'])} | {ms(g['normalised_accuracy'])} | {ms(g['bwt'])} | "
            + " | ".join(s.replace(".000", "") for s in secs)
            + " | "
            + " | ".join(mem)
            + f" | {g['state_mb'].mean():.0f} |"
        )
    return "\n".join(lines)


def versus(outs: dict, df: pd.DataFrame, orders: list, tasks: list[str], a: str, b: str) -> dict:
    """A against B: per order the difference of final average accuracy with its paired bootstrap
    interval (stratified by task), and the spread of each over orders."""
    if not {a, b} <= set(df["method"]):
        return {"text": f"(no {a} vs {b}: both must be among the methods)"}
    per_order = []
    for o in range(len(orders)):
        c = compare_tasks({t: (outs[o, a][t], outs[o, b][t]) for t in tasks}, n_boot=2000, seed=o)["mean"]
        per_order.append({"order": o, "diff": c.diff, "ci_low": c.ci_low, "ci_high": c.ci_high})
    diffs = np.array([p["diff"] for p in per_order])
    sd = {m: float(df[df["method"] == m]["final_accuracy"].std(ddof=1)) if len(orders) > 1 else 0.0 for m in (a, b)}
    mean = float(diffs.mean())
    beats = mean > max(sd.values()) and all(p["ci_low"] > 0 for p in per_order)
    lines = [f"\n## {a} - {b}, final average accuracy (points), per order with its 95% paired bootstrap interval"]
    lines += [
        f"order {p['order'] + 1}: {100 * p['diff']:+.1f} [{100 * p['ci_low']:+.1f}, {100 * p['ci_high']:+.1f}]"
        for p in per_order
    ]
    lines.append(
        f"mean {100 * mean:+.1f} (sd over orders {100 * diffs.std(ddof=1) if len(diffs) > 1 else 0:.1f}); "
        f"spread over orders: {a} {100 * sd[a]:.1f}, {b} {100 * sd[b]:.1f} points"
    )
    lines.append(
        f"verdict: {a} {'beats' if beats else 'does not beat'} {b} by more than the spread over orders"
        + ("" if beats else (" (it is behind)" if mean < 0 else ""))
    )
    return {"per_order": per_order, "mean": mean, "spread": sd, "beats": bool(beats), "text": "\n".join(lines)}


def plot_curves(results: list[dict], methods: list[str], tasks: list[str], path: str) -> None:
    """Accuracy after each arrival, normalised by each arrived task's own fine-tune (mean over the
    arrived tasks): the raw average mostly shows which task came first. Mean over orders, band
    +- one standard deviation over orders."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.arange(1, len(tasks) + 1)
    for i, m in enumerate(methods):
        c = np.array([r["normalised_curve"] for r in results if r["method"] == m])
        mean, sd = c.mean(0), (c.std(0, ddof=1) if len(c) > 1 else np.zeros(len(x)))
        ax.plot(x, mean, marker="o", ms=3, label=m, color=plt.cm.tab10(i % 10))
        ax.fill_between(x, mean - sd, mean + sd, alpha=0.15, color=plt.cm.tab10(i % 10))
    ax.axhline(1.0, ls="--", color="grey", lw=1, label="own fine-tunes")
    ax.set_xlabel("tasks arrived")
    ax.set_ylabel("accuracy / own fine-tune, mean over arrived tasks")
    ax.set_title(f"continual merging, {len(tasks)} tasks: mean over orders (band: +-1 sd)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def sweep_part(args, root: Path) -> None:
    """GS3R over energy x rank budget (x scale) in the workspace's order, scored on dev rows only."""
    params, specs, scorer = workspace(root, "dev")
    tasks = list(specs)
    store = FeatureStore(scorer)
    _, ft, _ = reference(store, specs, None)
    n_dev = {t: len(scorer.labels(t)) for t in tasks}
    print(f"## dev rows per task: {n_dev}; own fine-tunes on dev: mean {np.mean(list(ft.values())):.3f}")
    base_kwargs = dict(params.merge.methods.get("gs3r") or {})
    grid = list(itertools.product(args.energies, args.budgets, args.scales))
    opcm = {"opcm": params.merge.methods.get("opcm") or {}} if "opcm" in params.merge.methods else {}
    print(f"{'config':36s} {'dev acc':>8s} {'norm':>6s} {'rank mean':>9s} {'full':>5s} {'s/arrival':>9s}")
    with tempfile.TemporaryDirectory(prefix="merge-sweep-") as tmp:
        tmp = Path(tmp)
        from safetensors.torch import save_file

        theta0 = tmp / "theta0.safetensors"
        save_file({k: v.contiguous() for k, v in scorer.theta_0.items()}, str(theta0))
        runs = [("gs3r", {**base_kwargs, "energy": e, "rank_budget": k, "scale": s}) for e, k, s in grid]
        runs += [(m, kw) for m, kw in opcm.items()]
        for method, kwargs in runs:
            result = run_method(
                method, kwargs, theta0, [specs[t]["model"] for t in tasks], tmp / "w", "final", args.threads
            )
            from tasks.stages.merge import read_merged_state

            state = read_merged_state(tmp / "w" / f"{len(tasks) - 1}.safetensors", method, scorer.theta_0)
            name = f"{method}:{json.dumps(kwargs, sort_keys=True)}"
            acc = store.add(name, "merge", method, len(tasks) - 1, tasks, state=state)
            ranks = [r for r in result["ranks"] if r["arrival"] == len(tasks) - 1]
            rank_mean = np.mean([r["rank"] for r in ranks]) if ranks else float("nan")
            full = np.mean([r["rank"] >= r["budget"] for r in ranks]) if ranks else float("nan")
            secs = np.mean([r["add_seconds"] + r["merged_seconds"] for r in result["records"]])
            label = (
                method
                if method != "gs3r"
                else f"gs3r e={kwargs['energy']} K={kwargs['rank_budget']} s={kwargs['scale']}"
            )
            print(
                f"{label:36s} {np.mean(list(acc.values())):8.3f} {np.mean([acc[t] / ft[t] for t in tasks]):6.3f} "
                f"{rank_mean:9.1f} {full:5.2f} {secs:9.2f}",
                flush=True,
            )
            for p in (tmp / "w").glob("*.safetensors"):
                p.unlink()


def pick_methods(params, names: str, overrides: list[str] = ()) -> dict:
    """merge.methods (or the `--methods` subset), each `--kwargs METHOD=JSON` replacing that method's
    options (e.g. GS3R at another energy than the profile's, against the same fine-tunes)."""
    methods = dict(params.merge.methods)
    for item in overrides:
        name, _, text = item.partition("=")
        if name not in methods:
            raise SystemExit(f"--kwargs {item!r}: {name!r} not in merge.methods ({', '.join(methods)})")
        try:
            methods[name] = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--kwargs {item!r}: not METHOD=JSON ({e})") from None
    if not names:
        return methods
    unknown = [m for m in names.split(",") if m not in methods]
    if unknown:
        raise SystemExit(f"--methods: {unknown} not in merge.methods ({', '.join(methods)})")
    return {m: methods[m] for m in names.split(",")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(ROOT), help="the workspace (a profile's: build/<profile>)")
    ap.add_argument("--orders", type=int, default=3, help="arrival orders: given, reversed, then seeded shuffles")
    ap.add_argument("--order-list", default="", help="';'-separated orders, each ','-separated task names")
    ap.add_argument("--methods", default="", help="comma-separated subset of merge.methods")
    ap.add_argument("--kwargs", action="append", default=[], metavar="METHOD=JSON", help="replace a method's options")
    ap.add_argument("--eval-limit", type=int, default=100, help="test rows per task of the accuracy matrix (0 = all)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default="", help="write the results to this JSON file")
    ap.add_argument("--plot", default="", help="write the accuracy-after-each-arrival plot to this PNG")
    ap.add_argument("--sweep", action="store_true", help="GS3R's energy x rank budget on dev rows instead")
    ap.add_argument("--energies", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    root = Path(args.root).resolve()
    start = time.perf_counter()
    print(f"# merge_tasks: root={root} threads={args.threads}")
    if args.sweep:
        sweep_part(args, root)
    else:
        accuracy_part(args, root)
    print(f"\n# total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
