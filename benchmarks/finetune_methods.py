"""Fine-tuning methods side by side on the demo tasks, same budget, same seeds: plain fine-tuning,
Mixout, WiSE-FT (an alpha sweep over the plain run), GMixout; and the effect of the curation
(reference only / reference + unweighted pseudo-labels / reference + weighted pseudo-labels).

    python benchmarks/finetune_methods.py                                 # rotten, 3 seeds, 30 steps
    python benchmarks/finetune_methods.py --tasks rotten,bbc --steps 100 --max-length 128 --n-test 400

Reads data/<task>/{labeled,test}.parquet of the project (made by the default pipeline; read only).
Per task, seed and method: the base encoder (model.name) + a head trained for exactly `--steps`
optimizer steps (no early stopping; the dev split of tasks.stages.finetune is used only for the final
evaluation), then
- id: accuracy on the task's test set (first `--n-test` rows);
- shift: for rotten (fresh/rotten), accuracy on the tweets test set's positive/negative items
  (fresh -> positive, rotten -> negative): a movie-review model scored on tweets;
- steps/s, and its ratio to plain fine-tuning at the same seed (goal for GMixout: >= 1/1.2);
- peak memory: the largest process RSS sampled (every 10 ms) during training, minus the RSS
  before it (CPU; a rough figure);
WiSE-FT interpolates the plain run's encoder with the pretrained one (theta = (1 - a) theta_0 +
a theta_ft) and keeps the fine-tuned head. Means (and sd) over seeds are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from crucible.embed import load_encoder  # noqa: E402
from crucible.gmixout import GMixout, GMixoutConfig  # noqa: E402
from crucible.train import EncoderClassifier, Examples, TrainConfig, evaluate, tokenize, train, wise_ft  # noqa: E402
from tasks.data.models import resolve_model  # noqa: E402
from tasks.runtime.params_schema import FinetuneParams, GMixoutOptions  # noqa: E402
from tasks.stages.finetune import read_labeled, task_seed  # noqa: E402

SHIFT = {"rotten": ("tweets", {"fresh": "positive", "rotten": "negative"})}


class PeakRSS:
    """Peak resident memory of this process over a block, sampled in a thread."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def to_examples(tokenizer, texts, labels, classes, weights, max_length) -> Examples:
    index = {c: i for i, c in enumerate(classes)}
    return Examples(
        tokenize(tokenizer, list(texts), max_length),
        np.array([index[x] for x in labels], dtype=np.int64),
        np.asarray(weights, dtype=np.float32).copy(),
    )


def load_task(task: str, args, tokenizer):
    base = ROOT / "data" / task
    labeled = read_labeled(base / "labeled.parquet")
    test = pd.read_parquet(base / "test.parquet").head(args.n_test)
    classes = sorted(labeled.loc[labeled["source"] == "reference", "label"].unique())
    data = {
        "labeled": labeled,
        "classes": classes,
        "test": to_examples(tokenizer, test["text"], test["label"], classes, np.ones(len(test)), args.max_length),
    }
    if task in SHIFT:
        other, mapping = SHIFT[task]
        shifted = pd.read_parquet(ROOT / "data" / other / "test.parquet")
        inverse = {v: k for k, v in mapping.items()}
        shifted = shifted[shifted["label"].isin(inverse)].head(args.n_test)
        data["shift"] = to_examples(
            tokenizer, shifted["text"], shifted["label"].map(inverse), classes, np.ones(len(shifted)), args.max_length
        )
    return data


def training_rows(labeled: pd.DataFrame, dev: np.ndarray, variant: str) -> pd.DataFrame:
    rows = labeled[~dev & (labeled["weight"].to_numpy() > 0)].copy()
    if variant == "reference":
        return rows[rows["source"] == "reference"]
    if variant == "unweighted":
        rows["weight"] = 1.0
    return rows


def finetune_params(overrides: list[str]) -> FinetuneParams:
    """FinetuneParams defaults with `key=value` overrides (validated by the params schema)."""
    values = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        values[key] = yaml.safe_load(value)
    # a GMixout option (p, anchor, ema_beta, period, sparse) goes to finetune.gmixout, p to mixout too
    options = {k: values.pop(k) for k in list(values) if k in GMixoutOptions.model_fields}
    if options:
        values["gmixout"] = options
        if "p" in options:
            values["mixout"] = {"p": options["p"]}
    return FinetuneParams(**values)


def mixout_for(method: str, cfg: FinetuneParams, seed: int) -> GMixoutConfig | None:
    if method == "plain":
        return None
    if method == "mixout":
        return GMixoutConfig.mixout(p=cfg.mixout.p, modules=cfg.modules, seed=seed)
    return GMixoutConfig(
        p=cfg.gmixout.p,
        anchor=cfg.gmixout.anchor,
        ema_beta=cfg.gmixout.ema_beta,
        period=cfg.gmixout.period,
        sparse=cfg.gmixout.sparse,
        modules=cfg.modules,
        seed=seed,
    )


def run_one(task, data, method, variant, seed, args, encoder_path, tokenizer, base_state):
    cfg = args.cfg
    s = task_seed(seed, task)
    labeled = data["labeled"]
    dev_mask = labeled["split"].to_numpy() == "dev"  # pseudolabel's dev rows
    rows = training_rows(labeled, dev_mask, variant)
    train_set = to_examples(tokenizer, rows["text"], rows["label"], data["classes"], rows["weight"], args.max_length)
    dev_df = labeled[dev_mask]
    dev_set = to_examples(
        tokenizer, dev_df["text"], dev_df["label"], data["classes"], np.ones(len(dev_df)), args.max_length
    )
    encoder, _ = load_encoder(encoder_path)
    torch.manual_seed(s)
    model = EncoderClassifier(encoder, len(data["classes"]))
    mix = mixout_for(method, cfg, s)
    gm = GMixout.wrap(model.encoder, mix) if mix else None
    tcfg = TrainConfig(
        lr=cfg.lr,
        head_lr=cfg.head_lr,
        max_steps=args.steps,
        batch_size=args.batch_size,
        warmup=cfg.warmup,
        weight_decay=cfg.weight_decay,
        clip=cfg.clip,
        eval_every=args.steps,
        seed=s,
        progress=False,
        pad_id=tokenizer.pad_token_id or 0,
    )
    stamps = {}
    with PeakRSS() as mem:
        train(
            model,
            train_set,
            dev_set,
            tcfg,
            mixout=gm,
            log=lambda m, step: stamps.setdefault(step, time.perf_counter()) if "train_loss" in m else None,
        )
    steps_per_s = (args.steps - 1) / (stamps[args.steps] - stamps[1])
    if gm:
        gm.unwrap()
    out = {
        "task": task,
        "method": method,
        "variant": variant,
        "seed": seed,
        "steps_per_s": steps_per_s,
        "peak_mb": mem.delta_mb,
        "id": evaluate(model, data["test"])["accuracy"],
    }
    if "shift" in data:
        out["shift"] = evaluate(model, data["shift"])["accuracy"]
    results = [out]
    if method == "plain" and variant == "weighted":
        ft = {k: v.clone() for k, v in model.encoder.state_dict().items()}
        for alpha in args.alphas:
            model.encoder.load_state_dict(wise_ft(base_state, ft, alpha))
            row = {**out, "method": f"wise-ft a={alpha:g}", "id": evaluate(model, data["test"])["accuracy"]}
            if "shift" in data:
                row["shift"] = evaluate(model, data["shift"])["accuracy"]
            results.append(row)
    return results


def speed(task, data, args, encoder_path, tokenizer) -> None:
    """Steps per second of each method relative to plain, robust to a noisy machine: the methods
    take turns, `--speed-block` optimizer steps each, for `--speed-rounds` rounds, in one process;
    per method the total time of its blocks. Blocks are whole `train` calls (optimizer set-up and a
    40-item dev evaluation included, the same for every method)."""
    cfg = args.cfg
    s = task_seed(0, task)
    labeled = data["labeled"]
    dev_mask = labeled["split"].to_numpy() == "dev"  # pseudolabel's dev rows
    rows = training_rows(labeled, dev_mask, "weighted")
    train_set = to_examples(tokenizer, rows["text"], rows["label"], data["classes"], rows["weight"], args.max_length)
    dev_df = labeled[dev_mask].head(40)
    dev_set = to_examples(
        tokenizer, dev_df["text"], dev_df["label"], data["classes"], np.ones(len(dev_df)), args.max_length
    )
    methods = [m for m in args.methods.split(",") if m]
    runs = {}
    for method in methods:
        encoder, _ = load_encoder(encoder_path)
        torch.manual_seed(s)
        model = EncoderClassifier(encoder, len(data["classes"]))
        mix = mixout_for(method, cfg, s)
        runs[method] = (model, GMixout.wrap(model.encoder, mix) if mix else None)
    tcfg = TrainConfig(
        lr=cfg.lr,
        head_lr=cfg.head_lr,
        max_steps=args.speed_block,
        batch_size=args.batch_size,
        warmup=cfg.warmup,
        weight_decay=cfg.weight_decay,
        clip=cfg.clip,
        eval_every=args.speed_block,
        seed=s,
        progress=False,
        pad_id=tokenizer.pad_token_id or 0,
    )
    seconds = {m: [] for m in methods}
    for r in range(args.speed_rounds):
        for method in methods if r % 2 == 0 else methods[::-1]:
            model, gm = runs[method]
            start = time.perf_counter()
            train(model, train_set, dev_set, tcfg, mixout=gm)
            seconds[method].append(time.perf_counter() - start)
    base = sum(seconds["plain"]) if "plain" in seconds else None
    print(
        f"\n## speed ({task}, {args.speed_rounds} rounds x {args.speed_block} steps per method, taking turns, "
        f"threads={args.threads})"
    )
    print(f"{'method':10s} {'steps/s':>8s} {'x plain':>8s} {'slowdown':>9s}")
    for method in methods:
        total = sum(seconds[method])
        rate = args.speed_rounds * args.speed_block / total
        ratio = base / total if base else float("nan")
        print(f"{method:10s} {rate:8.3f} {ratio:8.2f} {1 / ratio:8.2f}x")


def fmt(values) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f}±{sd:.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="rotten", help="comma-separated demo tasks")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (same budget for every method)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--n-test", type=int, default=200, help="test (and shifted) items scored per task")
    ap.add_argument("--alphas", default="0.25,0.5,0.75", help="WiSE-FT mixing coefficients")
    ap.add_argument("--curation-task", default="rotten", help="task of the curation ablation ('' = skip)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default="plain,mixout,gmixout", help="methods compared (WiSE-FT comes with plain)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a finetune param for this run (e.g. --set p=0.5 --set ema_beta=0.9)",
    )
    ap.add_argument(
        "--speed-rounds",
        type=int,
        default=0,
        help="only the speed comparison: methods take turns for this many rounds (on the first task)",
    )
    ap.add_argument("--speed-block", type=int, default=10, help="optimizer steps per turn in the speed comparison")
    args = ap.parse_args(argv)
    args.cfg = finetune_params(args.set)
    args.alphas = [float(a) for a in args.alphas.split(",") if a]
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]
    encoder_path = resolve_model("all-MiniLM-L6-v2")
    encoder, tokenizer = load_encoder(encoder_path)
    base_state = {k: v.clone() for k, v in encoder.state_dict().items()}
    cfg = args.cfg
    print(
        f"# finetune_methods: tasks={tasks} seeds={seeds} steps={args.steps} batch={args.batch_size} "
        f"max_length={args.max_length} n_test={args.n_test} threads={args.threads}; "
        f"GMixout p={cfg.gmixout.p} anchor={cfg.gmixout.anchor} beta={cfg.gmixout.ema_beta} "
        f"period={cfg.gmixout.period} sparse={cfg.gmixout.sparse}; "
        f"Mixout p={cfg.p}; lr={cfg.lr} head_lr={cfg.head_lr}",
        flush=True,
    )

    if args.speed_rounds:
        speed(tasks[0], load_task(tasks[0], args, tokenizer), args, encoder_path, tokenizer)
        return
    jobs = [(t, m, "weighted") for t in tasks for m in args.methods.split(",") if m]
    if args.curation_task:
        jobs += [(args.curation_task, "gmixout", v) for v in ("reference", "unweighted")]
        if args.curation_task not in tasks:
            jobs.append((args.curation_task, "gmixout", "weighted"))
    data = {t: load_task(t, args, tokenizer) for t in {j[0] for j in jobs}}
    rows = []
    start = time.perf_counter()
    for seed in seeds:
        for task, method, variant in jobs:
            rows += run_one(task, data[task], method, variant, seed, args, encoder_path, tokenizer, base_state)
            r = rows[-1] if not rows[-1]["method"].startswith("wise") else rows[-1 - len(args.alphas)]
            print(
                f"  seed {seed} {task:8s} {method:8s} {variant:10s} id={r['id']:.3f} "
                f"shift={r.get('shift', float('nan')):.3f} "
                f"steps/s={r['steps_per_s']:.2f} [{time.perf_counter() - start:.0f}s]",
                file=sys.stderr,
                flush=True,
            )
    df = pd.DataFrame(rows)
    plain = df[df["method"] == "plain"].set_index(["task", "variant", "seed"])["steps_per_s"]
    df["speed_vs_plain"] = [r.steps_per_s / plain.get((r.task, "weighted", r.seed), np.nan) for r in df.itertuples()]
    if "shift" not in df:
        df["shift"] = np.nan

    print("\n## methods (reference + weighted pseudo-labels), mean±sd over seeds")
    print(
        f"{'task':8s} {'method':16s} {'id acc':>12s} {'shift acc':>12s} {'steps/s':>12s} "
        f"{'x plain':>8s} {'peak MB':>8s}"
    )
    for (task, method), g in df[df["variant"] == "weighted"].groupby(["task", "method"], sort=False):
        wise = method.startswith("wise")
        print(
            f"{task:8s} {method:16s} {fmt(g['id']):>12s} {fmt(g['shift']):>12s} "
            f"{'(= plain)' if wise else fmt(g['steps_per_s']):>12s} "
            f"{'' if wise else format(g['speed_vs_plain'].mean(), '.2f'):>8s} "
            f"{'' if wise else format(g['peak_mb'].mean(), '.0f'):>8s}"
        )
    if args.curation_task:
        print(f"\n## curation ({args.curation_task}, GMixout), mean±sd over seeds")
        print(f"{'training rows':34s} {'id acc':>12s} {'shift acc':>12s}")
        names = {
            "reference": "reference only",
            "unweighted": "reference + pseudo, weight 1",
            "weighted": "reference + pseudo, weighted",
        }
        sub = df[(df["task"] == args.curation_task) & (df["method"] == "gmixout")]
        for variant in ("reference", "unweighted", "weighted"):
            g = sub[sub["variant"] == variant]
            print(f"{names[variant]:34s} {fmt(g['id']):>12s} {fmt(g['shift']):>12s}")
    print(f"\n# total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
