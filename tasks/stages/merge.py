"""Stage `merge` (once, over all tasks): continual merging of the task models (docs/methods.md, merge;
crucible.merge), every method of `merge.methods` on the same arrival sequence.

    crucible stage merge

Reads, per task in `merge.order` (default: the order of pipeline.tasks), the finetune stage's
data/<task>/finetune/{model,head}.safetensors and config.json, and data/<task>/test.parquet; the
base model is `model.name`; every task model must have been fine-tuned from it, from the same
content (its config.json's `base_model_hash` equals models/base/manifest.json's hash), or the stage
stops naming the fine-tune to rebuild.

Per method, in a fresh process (tasks/data/merge_worker.py; its peak memory is its own): load
theta_0; for each arriving task, load theta_t, turn it into its task vector in place, `merger.add`
it and drop it, then build the merged weights. Recorded per arrival: seconds in add and in
merged(), the peak RSS above the RSS with theta_0 loaded (sampled every 5 ms over load + add +
merged, saving excluded), the bytes of the merger's state, and the rank held per matrix (GS3R).
When `merge.evaluate`, the parent then scores each arrival's merged model on every task arrived so
far (keeping its features for the evaluate stage), each task with its own head (heads are kept per
task, never merged), beside the base model and each task's own fine-tune; crucible.continual turns
the accuracy matrix into average accuracy, accuracy normalised by the fine-tunes, and backward
transfer. Weights the parent has scored already (the same state_digest: weight average, MagMax at
lam 1 and OPCM all give theta_0 + tau_1 at the first arrival) are not encoded again, their features
copied (tasks.data.heldout_scoring.FeatureStore), which changes no byte of the outputs. Methods run
one after another: a worker merging beside the parent's scoring was slower on 2 cores.

Outputs (all published together) under models/merge/:
- model.safetensors: the `merge.main` method's final merged encoder (the base model's keys);
- heads.safetensors: `<task>.weight`, `<task>.bias` per task; metadata `classes` (JSON per task);
- config.json: order, methods and their arguments, main, base model, classes and max_length per task;
- features.safetensors: the frozen features (what the heads see) of the base encoder, each fine-tune
  and every method's merged model after every arrival, on each arrived task's test rows and probe
  rows (`evaluate.probe_rows`), for the evaluate stage (tasks.data.heldout_scoring.FeatureStore; empty of
  variants when `merge.evaluate` is off);
- metrics/merge.json: metrics (main method at top level, every method under `methods`: accuracy matrix,
  ACC, BWT, state size, ranks; seconds and peak RSS go to the MLflow run only, as they vary from
  run to run);
- metrics/merge_accuracy.csv: method, arrival, task, accuracy (long format, for `dvc plots`), incl. base/finetuned;
- metrics/merge_ranks.csv: method, arrival, param, rank, budget (methods that hold a low-rank state);
- accuracy.png: accuracy of every task after each arrival, per method.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tasks.data.head_refit import dev_ids, refit_heads
from tasks.data.heldout_scoring import FeatureStore, Scorer, probe_ids, read_probe_rows, read_task_model, read_tests
from tasks.data.merge_worker import SCRATCH_HINT, start_method
from tasks.data.models import base_model
from tasks.runtime.declaration import Plot, StageSpec
from tasks.runtime.device import current, runtime_config
from tasks.runtime.io import AtomicOutputs, figure_png, json_safe, read_safetensors, rebuild_hint
from tasks.runtime.params_schema import Params
from tasks.runtime.paths import BASE_MANIFEST, MERGE, METRICS
from tasks.runtime.scratch import scratch
from tasks.runtime.tracking import say

TIMING = ("merge_seconds", "add_seconds", "merged_seconds", "peak_rss_mb", "peak_rss_mb_by_arrival")


SPEC = StageSpec(
    name="merge",
    per_task=False,
    comment="Once over all tasks: the fine-tunes merged in arrival order by every method, scored on each "
    "task's test rows and probe rows (the reference, or labeled rows: evaluate.probe_rows).",
    deps=(
        str(BASE_MANIFEST),
        "data/{task}/finetune",
        "data/{task}/test.parquet",
        "data/{task}/reference.parquet",
        "data/{task}/labeled.parquet",
    ),
    params=("pipeline.seed", "pipeline.tasks", "model", "merge", "evaluate.probe_rows", "evaluate.probe_limit"),
    outs=tuple(
        str(MERGE / n) for n in ("model.safetensors", "heads.safetensors", "config.json", "features.safetensors")
    ),
    metrics=(str(METRICS / "merge.json"),),
    plots=(
        Plot(str(METRICS / "merge_accuracy.csv"), x="arrival", y="accuracy"),
        Plot(str(METRICS / "merge_ranks.csv")),
        Plot(str(MERGE / "accuracy.png")),
    ),
)


# ---------------------------------------------------------------------------------------------------
# the merged weights (written by tasks/data/merge_worker.py, one fresh process per method)


def _shapes(state: dict) -> dict:
    """{name: shape} of a state dict: what a file of the same architecture must hold."""
    return {k: tuple(v.shape) for k, v in state.items()}


def read_merged_state(path: Path, what: str, theta_0: dict) -> dict:
    """A merged encoder a worker wrote: theta_0's tensor names and shapes, every value finite."""
    state, _ = read_safetensors(path, f"merged encoder of {what}", SCRATCH_HINT, shapes=_shapes(theta_0))
    return state


# ---------------------------------------------------------------------------------------------------
# the accuracy matrix


def merge_method(
    method: str,
    kwargs: dict,
    theta0_file: Path,
    specs: list[dict],
    out_dir: Path,
    store: FeatureStore | None,
    finetuned: dict[str, float],
    threads: int,
    device: str = "cpu",
    limit: int | None = None,
    full_last: bool = False,
) -> tuple[dict, list, list]:
    """One method over the sequence `specs` (arrival order): its worker's time/memory records and, with
    a feature store, the accuracy matrix R[j, i] (task i after arrival j, i <= j) and its summaries;
    the features of every arrival's merged model on the arrived tasks go into the store (variant
    `<method>@<j>`; an arrival whose weights the store has scored already is not encoded again).
    The worker runs in its own process (tasks.data.merge_worker); interrupted while waiting for it,
    it is killed, so none outlives the stage. Each arrival is scored on the first `limit` test rows
    (the matrix); with `full_last`, the last arrival's model on every test row (the deployable
    model, compared row by row in evaluate), its matrix entry still on the first `limit`. Returns
    (summary entry, accuracy rows, rank rows); the merged weights stay in `out_dir`."""
    from crucible.continual import accuracy_curve, average_accuracy, backward_transfer, normalised_accuracy

    order = [s["task"] for s in specs]
    worker = start_method(
        method,
        kwargs,
        theta0_file,
        [s["model"] for s in specs],
        out_dir,
        "each" if store is not None else "final",
        threads,
        device,
    )
    try:
        result = worker.result()
    except BaseException:
        worker.stop()
        raise
    recs = result["records"]
    ranks = [{"method": method, **r} for r in result["ranks"]]
    entry = {
        "merge_seconds": sum(r["add_seconds"] + r["merged_seconds"] for r in recs),
        "add_seconds": [r["add_seconds"] for r in recs],
        "merged_seconds": [r["merged_seconds"] for r in recs],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in recs),
        "peak_rss_mb_by_arrival": [r["peak_rss_mb"] for r in recs],
        "state_mb": recs[-1]["state_mb"],
        "state_mb_by_arrival": [r["state_mb"] for r in recs],
    }
    if result["ranks"]:
        last = [r for r in result["ranks"] if r["arrival"] == len(specs) - 1]
        entry["rank_mean"] = float(np.mean([r["rank"] for r in last]))
        entry["rank_max"] = int(max(r["rank"] for r in last))
        budget = {r["param"]: r["budget"] for r in last}
        held = result.get("held_by_arrival") or {}
        if held:  # where the rank budget went: per arrival, its share of each matrix's budget, averaged
            entry["budget_share_by_arrival"] = [
                float(np.mean([held[k].get(str(j), 0) / budget[k] for k in held])) for j in range(len(specs))
            ]
    rows = []
    if store is not None:
        R = np.full((len(specs), len(specs)), np.nan)
        for j in range(len(specs)):
            state = read_merged_state(out_dir / f"{j}.safetensors", f"{method} after arrival {j}", store.scorer.theta_0)
            name, last = f"{method}@{j}", j == len(specs) - 1
            store.add(
                name, "merge", method, j, order[: j + 1], state=state, test_limit=None if full_last and last else limit
            )
            for i in range(j + 1):
                R[j, i] = store.accuracy(name, order[i], limit)
                rows.append({"method": method, "arrival": j, "task": order[i], "accuracy": R[j, i]})
        entry.update(
            {
                "avg_accuracy": average_accuracy(R),
                "normalised_accuracy": normalised_accuracy(R, [finetuned[t] for t in order]),
                "bwt": backward_transfer(R),
                "accuracy_curve": accuracy_curve(R),
                "final_accuracy": dict(zip(order, R[-1].tolist())),
                "R": R.tolist(),
            }
        )
    return entry, rows, ranks


def reference_accuracy(store: FeatureStore, specs: list[dict], limit: int | None = None) -> tuple[dict, dict]:
    """(base model accuracy, own fine-tune accuracy) per task on the first `limit` test rows (the
    continual matrices' rows). Into the store go, on every test row, the base encoder's features on
    every task (variant `base`) and each fine-tune's on the tasks arrived up to it (variant
    `finetune:<task>`, for evaluate's swap-in-the-latest-fine-tune baseline and its comparisons)."""
    order = [s["task"] for s in specs]
    store.add("base", "base", "base", -1, order, state=store.scorer.theta_0)
    base = {t: store.accuracy("base", t, limit) for t in order}
    finetuned = {}
    for j, spec in enumerate(specs):
        t = spec["task"]
        state, _ = read_safetensors(
            spec["model"],
            f"fine-tuned encoder of task {t!r}",
            rebuild_hint("finetune", t),
            shapes=_shapes(store.scorer.theta_0),
        )
        store.add(f"finetune:{t}", "finetune", "finetune", j, order[: j + 1], state=state)
        finetuned[t] = store.accuracy(f"finetune:{t}", t, limit)
    return base, finetuned


# ---------------------------------------------------------------------------------------------------
# the stage


def worker_device(theta_0: dict, methods: dict, headroom: float = 6.0) -> str:
    """Where the merge workers run: the run's device (tasks/runtime/device.py) when the merger's
    state fits there, else the CPU. A worker holds theta_0, a task vector and the merger's state
    (GS3R and OPCM keep per-matrix bases, a few model sizes): `headroom` model sizes of free GPU
    memory are asked for, and a GPU without them gets the CPU with a message saying so."""
    import torch

    device = current().device
    if device.type != "cuda":
        return "cpu"
    need = headroom * sum(v.numel() * 4 for v in theta_0.values())
    free, _ = torch.cuda.mem_get_info(device)
    if free < need:
        say(
            f"merge: {free / 2**30:.1f} GiB free on {device}, {need / 2**30:.1f} GiB wanted for "
            f"{', '.join(methods)}: the merge workers run on the CPU"
        )
        return "cpu"
    return str(device)


def run(params: Params, task: str | None, root: Path, log) -> dict:
    """Read the fine-tunes, merge them by every method in arrival order (scoring each arrival), choose
    the main method, refit the heads, write, log."""
    root = Path(root)
    inputs = read_inputs(params, root)
    merged = merge_all(params, root, inputs)
    deployed = deploy(params, root, inputs, merged)
    metrics, timing = write_outputs(params, root, inputs, merged, deployed)
    log_results(log, root, merged["summary"], timing)
    result = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**result, **{k: timing[deployed["main"]][k] for k in ("merge_seconds", "peak_rss_mb")}}


def read_inputs(params: Params, root: Path) -> dict:
    """The base model, every task's fine-tune (checked against it), the test and probe rows tokenised
    once (Scorer), and an empty feature store."""
    cfg = params.merge
    order = params.merge_order()
    base = base_model(params, root)
    specs = [read_task_model(root, t, base.name, base.hash) for t in order]
    scorer = Scorer(
        base,
        specs,
        read_tests(root, params),
        cfg.eval_batch_size,
        probes=read_probe_rows(root, params) if cfg.evaluate else None,
    )
    other = [s["task"] for s in specs if s["pooling"] != scorer.pooling]
    if other:
        raise ValueError(
            f"data/{other[0]}/finetune/config.json: pooled {specs[order.index(other[0])]['pooling']!r}, "
            f"but model.pooling now resolves to {scorer.pooling!r}; rerun finetune@{other[0]}"
        )
    return {"order": order, "base": base, "specs": specs, "scorer": scorer, "store": FeatureStore(scorer)}


def merge_all(params: Params, root: Path, inputs: dict) -> dict:
    """Every method over the arrival sequence, one worker process at a time; each arrival's merged model
    scored (when merge.evaluate) beside the base model and the fine-tunes; every final merged state."""
    import torch
    from safetensors.torch import save_file

    from crucible.progress import Progress

    cfg, order, specs, store = params.merge, inputs["order"], inputs["specs"], inputs["store"]
    theta_0 = inputs["scorer"].theta_0
    rows, ranks, summary, finetuned, base_acc = [], [], {}, {}, {}
    with scratch(root, "merge") as tmp:  # in the workspace; a killed run's folder goes at the next start
        theta0_file = tmp / "theta0.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in theta_0.items()}, str(theta0_file))
        device = worker_device(theta_0, cfg.methods)
        if cfg.evaluate:
            base_acc, finetuned = reference_accuracy(store, specs, cfg.eval_limit)
            rows += [
                {"method": ref, "arrival": None, "task": t, "accuracy": acc[t]}
                for t in order
                for ref, acc in (("base", base_acc), ("finetuned", finetuned))
            ]
        # one method at a time: a worker merging beside the parent's scoring (one ahead) measured
        # slower on 2 cores (both processes want every core: the stage took 490 s against 305 s)
        for method, kwargs in Progress(list(cfg.methods.items()), desc="merge: methods", unit="method"):
            entry, method_rows, method_ranks = merge_method(
                method,
                kwargs or {},
                theta0_file,
                specs,
                tmp / method,
                store if cfg.evaluate else None,
                finetuned,
                torch.get_num_threads(),
                device,
                limit=cfg.eval_limit,
                full_last=method == cfg.main,
            )
            summary[method], rows, ranks = entry, rows + method_rows, ranks + method_ranks
        main, choice = cfg.main, {}
        if cfg.main == "auto":
            choice = choose_main(store, list(cfg.methods), order, probe_ids(inputs["scorer"]), dev_ids(root, order))
            main = max(choice, key=choice.get)
        final = read_merged_state(
            tmp / main / f"{len(specs) - 1}.safetensors", f"{main} after the last arrival", theta_0
        )
    if cfg.main == "auto":  # the chosen final model on every test row (the matrix keeps its first rows)
        store.add(f"{main}@{len(order) - 1}", "merge", main, len(order) - 1, order, state=final)
    return {
        "rows": rows,
        "ranks": ranks,
        "summary": summary,
        "finetuned": finetuned,
        "base_acc": base_acc,
        "main": main,
        "choice": choice,
        "final": final,
    }


def choose_main(store: FeatureStore, methods: list[str], order: list[str], probe_ids: dict, dev: dict) -> dict:
    """{method: mean over tasks of its final merged model's accuracy on the task's dev rows, through
    the task's fine-tune head}: merge.main auto takes the highest (the first of ties)."""
    out = {}
    for m in methods:
        accs = []
        for t in order:
            x = store.tensors[f"{m}@{len(order) - 1}/{t}/probe"]
            y = store.tensors[f"labels/{t}/probe"]
            is_dev = torch.tensor([i in dev[t] for i in probe_ids[t]], dtype=torch.bool)
            accs.append(float((store.scorer.head_logits(t, x[is_dev]).argmax(1) == y[is_dev]).float().mean()))
        out[m] = float(np.mean(accs))
    return out


def deploy(params: Params, root: Path, inputs: dict, merged: dict) -> dict:
    """The heads the main method's model is deployed with: refitted on its features where that wins on
    the dev rows (merge.refit_heads), else the fine-tunes' own."""
    cfg, order, specs, main = params.merge, inputs["order"], inputs["specs"], merged["main"]
    kept = {s["task"]: (s["head"]["weight"], s["head"]["bias"]) for s in specs}
    if not cfg.evaluate:
        return {"main": main, "choice": {}, "heads": kept, "refit": {}}
    heads, refit = refit_heads(
        inputs["store"],
        f"{main}@{len(order) - 1}",
        kept,
        probe_ids(inputs["scorer"]),
        dev_ids(root, order),
        cfg.refit_heads,
        params.pipeline.seed,
    )
    return {"main": main, "choice": merged["choice"], "heads": heads, "refit": refit}


def write_outputs(params: Params, root: Path, inputs: dict, merged: dict, deployed: dict) -> tuple[dict, dict]:
    """The main method's encoder, the deployed and the fine-tunes' heads, the config, the features, the
    metrics and the plot, published together. Returns (merge.json's metrics, the timings)."""
    from crucible.serialize import safetensors_bytes

    order, specs, base, summary, main = (
        inputs["order"],
        inputs["specs"],
        inputs["base"],
        merged["summary"],
        deployed["main"],
    )
    task_heads = {f"{s['task']}.{k}": v.contiguous() for s in specs for k, v in s["head"].items()}
    heads = {
        f"{t}.{k}": v.contiguous() for t, (w, b) in deployed["heads"].items() for k, v in (("weight", w), ("bias", b))
    }
    config = {
        "order": order,
        "main": main,
        "main_param": params.merge.main,
        "methods": params.merge.methods,
        "base_model": base.name,
        "base_model_hash": base.hash,
        "pooling": inputs["scorer"].pooling,
        "dtype": base.dtype,
        "classes": {s["task"]: s["classes"] for s in specs},
        "max_length": {s["task"]: s["max_length"] for s in specs},
        "refit": {t: r["refit"] for t, r in deployed["refit"].items()},
        "runtime": runtime_config(),
    }
    # seconds and peak RSS vary run to run: MLflow gets them, the DVC-tracked merge.json does not, so
    # the same params give the same bytes
    timing = {m: {k: e.pop(k) for k in TIMING if k in e} for m, e in summary.items()}
    metrics = json_safe(
        {
            "main": main,
            "main_dev_accuracy": deployed["choice"],
            "tasks": len(order),
            **{
                k: summary[main][k]
                for k in ("avg_accuracy", "normalised_accuracy", "bwt", "state_mb")
                if k in summary[main]
            },
            "base_accuracy": merged["base_acc"],
            "finetuned_accuracy": merged["finetuned"],
            "refit": deployed["refit"],
            "methods": summary,
        }
    )
    out, classes = root / MERGE, {"classes": json.dumps(config["classes"])}
    meta = {"format": "pt", "base_model": base.name, "method": main, "order": json.dumps(order)}
    with AtomicOutputs() as atomic:
        atomic.bytes(safetensors_bytes(merged["final"], meta), out / "model.safetensors")
        atomic.bytes(safetensors_bytes(heads, classes), out / "heads.safetensors")
        atomic.bytes(safetensors_bytes(task_heads, classes), out / "task_heads.safetensors")
        atomic.json(config, out / "config.json")
        atomic.bytes(inputs["store"].to_bytes(), out / "features.safetensors")
        atomic.json(metrics, root / METRICS / "merge.json")
        atomic.bytes(
            _csv(merged["rows"], ["method", "arrival", "task", "accuracy"]), root / METRICS / "merge_accuracy.csv"
        )
        atomic.bytes(
            _csv(merged["ranks"], ["method", "arrival", "param", "rank", "budget"]), root / METRICS / "merge_ranks.csv"
        )
        atomic.bytes(plot_accuracy(merged["rows"], order, summary), out / "accuracy.png")
    return metrics, timing


def _csv(rows: list[dict], columns: list[str]) -> bytes:
    return pd.DataFrame(rows, columns=columns).to_csv(index=False).encode()


def log_results(log, root: Path, summary: dict, timing: dict) -> None:
    flat = {}
    for method, entry in summary.items():
        entry = {**entry, **timing[method]}
        for k in ("avg_accuracy", "normalised_accuracy", "bwt", "merge_seconds", "peak_rss_mb", "state_mb"):
            if k in entry and entry[k] == entry[k]:
                flat[f"{method}.{k}"] = entry[k]
    log.log_metrics(flat)
    log.log_artifact(root / MERGE / "accuracy.png")
    log.log_artifact(root / METRICS / "merge.json")


def plot_accuracy(rows: list[dict], order: list[str], summary: dict) -> bytes:
    """PNG: one panel per task (accuracy after each arrival, a line per method; fine-tune dashed, base
    dotted), and a panel of the average over the arrived tasks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = pd.DataFrame(rows, columns=["method", "arrival", "task", "accuracy"])
    n = len(order) + 1
    cols = min(n, 3)
    fig, axes = plt.subplots(-(-n // cols), cols, figsize=(4.2 * cols, 3.2 * -(-n // cols)), squeeze=False)
    methods = list(summary)
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for ax, t in zip(axes.flat, order):
        sub = df[df["task"] == t]
        for m in methods:
            g = sub[sub["method"] == m].sort_values("arrival")
            if len(g):
                ax.plot(g["arrival"] + 1, g["accuracy"], marker="o", color=colors[m], label=m)
        for ref, style in (("finetuned", "--"), ("base", ":")):
            g = sub[sub["method"] == ref]
            if len(g):
                ax.axhline(float(g["accuracy"].iloc[0]), color="k", ls=style, lw=1, label=ref)
        ax.set_title(f"{t} (arrives {order.index(t) + 1})")
        ax.set_xlim(0.5, len(order) + 0.5)
        ax.set_xticks(range(1, len(order) + 1))
        ax.set_xlabel("tasks merged")
        ax.set_ylabel("test accuracy")
    ax = axes.flat[len(order)]
    ft = df[df["method"] == "finetuned"].set_index("task")["accuracy"]
    for m in methods:
        g = df[df["method"] == m].copy()
        if not len(g) or ft.empty:
            continue
        g["norm"] = g["accuracy"] / g["task"].map(ft)
        curve = g.groupby("arrival")["norm"].mean()
        ax.plot(curve.index + 1, curve.values, marker="o", color=colors[m], label=m)
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_title("mean over arrived tasks of acc / own fine-tune", fontsize=9)
    ax.set_xticks(range(1, len(order) + 1))
    ax.set_xlabel("tasks merged")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    spare = list(axes.flat)[n:]
    for extra in spare:
        extra.axis("off")
    (spare[0] if spare else ax).legend(handles, labels, fontsize=8, loc="center" if spare else "best")
    fig.tight_layout()
    return figure_png(fig)
