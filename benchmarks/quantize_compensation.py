"""MXFP4 and low-rank compensation on a real merged encoder: accuracy per task of the float model,
MXFP4 alone, and MXFP4 + adapters for every scaling x allocation at the same total rank, plus
load-aware at the same adapter bytes as uniform; sizes and bits per weight.

    .venv/bin/python benchmarks/quantize_compensation.py --root .            # after `make run`
    .venv/bin/python benchmarks/quantize_compensation.py --root . --budget 288 --seeds 0 1 2

--root is a project whose merge stage has run (models/merge/, data/<task>/reference and test).
Params (modules, mode, calibration_per_task, merge.eval_limit, adapter_dtype) come from its
params.yaml; --budget overrides quantize.rank_per_matrix x matrices. Each seed is one calibration draw (seed 0:
the first rows, as the stage takes them; others: a random draw of the same size); the table shows
the mean over seeds and, where there are several, the spread (max - min) of the mean accuracy.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def budget_for_bytes(plan, allocation: str, max_bytes: int, itemsize: int) -> int:
    """The largest total rank whose `allocation` fits in max_bytes of adapters (bisection)."""
    lo, hi = 0, plan.total_rank
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan.adapter_bytes(plan.ranks(mid, allocation), itemsize) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument(
        "--budget", type=int, default=None, help="total rank (default: quantize.rank_per_matrix x matrices)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--mode", choices=["floor", "ceil"], default=None, help="MXFP4 scale mode (default: quantize.mode)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--configs",
        nargs="+",
        type=lambda v: tuple(v.split("/")),
        default=[
            ("plain", "unit"),
            ("plain", "input_energy"),
            ("qera", "unit"),
            ("lqer", "unit"),
            ("qera", "sensitivity"),
        ],
        help="scaling/load pairs to compare (default: all)",
    )
    ap.add_argument(
        "--eval-limit",
        type=int,
        default=None,
        help="test items per task (default: merge.eval_limit; 0 = the whole test split)",
    )
    args = ap.parse_args()
    import torch

    from crucible.quant import CompensationPlan, quantize_model, save_quantized, select_linears
    from tasks.data.heldout_scoring import Scorer
    from tasks.data.models import resolve_model
    from tasks.runtime.io import read_table
    from tasks.runtime.params import load_params
    from tasks.stages.quantize import calibrate, calibration_batches, read_merged

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    root = args.root.resolve()
    params = load_params(root / "params.yaml")
    cfg = params.quantize
    if args.mode:
        cfg = cfg.model_copy(update={"mode": args.mode})
    itemsize = torch.empty((), dtype=getattr(torch, cfg.adapter_dtype)).element_size()
    merged = read_merged(root, params.model.name)
    order = params.merge_order()
    specs = [
        {
            "task": t,
            "head": merged["heads"][t],
            "classes": merged["classes"][t],
            "max_length": int(merged["max_length"].get(t, 64)),
        }
        for t in order
    ]
    tests = {}
    for t in order:
        test = read_table(root / "data" / t / "test.parquet", "test")
        limit = params.merge.eval_limit if args.eval_limit is None else args.eval_limit
        tests[t] = test.head(limit) if limit else test
    scorer = Scorer(resolve_model(params.model.name), specs, tests, cfg.eval_batch_size)
    scorer.load(merged["state"])
    float_encoder = scorer.encoder
    linears = select_linears(float_encoder, cfg.modules)
    budget = params.rank_budget(len(linears)) if args.budget is None else args.budget
    n_weights = sum(m.weight.numel() for m in linears.values())

    reference_logits: dict = {}

    def score(encoder) -> dict:
        """accuracy per task, and (once the float logits are known) agreement with the float model's
        predictions and the relative logit error, over all tasks' test items"""
        scorer.use_encoder(encoder)
        out, agree, err, n = {}, 0.0, 0.0, 0
        for t in order:
            z = scorer.logits(t)
            out[t] = scorer.accuracy(t, z)
            if t in reference_logits:
                ref = reference_logits[t]
                agree += float((z.argmax(1) == ref.argmax(1)).sum())
                err += float(((z - ref).norm(dim=1) / ref.norm(dim=1)).sum())
                n += len(z)
            else:
                reference_logits[t] = z
        if n:
            out["_agree"], out["_logit_err"] = agree / n, err / n
        return out

    print(
        f"# quantize_compensation: root={root} tasks={order} budget={budget} seeds={args.seeds} mode={cfg.mode} "
        f"calibration_per_task={cfg.calibration_per_task} eval_limit={limit or None} adapter={cfg.adapter_dtype} "
        f"threads={torch.get_num_threads()}"
    )
    print(
        f"# {len(linears)} matrices, {n_weights / 1e6:.2f} M weights; test items per task: "
        f"{ {t: len(tests[t]) for t in order} }"
    )
    t0 = time.perf_counter()
    results: dict[str, list[dict]] = {}
    info: dict[str, dict] = {}
    float_acc = score(float_encoder)
    zero = {n: 0 for n in linears}
    enc0 = copy.deepcopy(float_encoder)
    quantize_model(enc0, cfg.modules, cfg.mode)
    mx_acc = score(enc0)
    mx_mb = len(save_quantized(enc0)) / 2**20
    del enc0
    timings = {"score_float_and_mxfp4": time.perf_counter() - t0}
    for seed in args.seeds:
        batches = calibration_batches(
            root, params, scorer.tokenizer, merged["classes"], merged["max_length"], seed=None if seed == 0 else seed
        )
        t1 = time.perf_counter()
        scorer.use_encoder(float_encoder)
        stats, sensitivity = calibrate(scorer, linears, batches, sensitivity=True)
        timings["calibration"] = time.perf_counter() - t1
        for scaling, load in args.configs:
            t1 = time.perf_counter()
            plan = CompensationPlan.build(linears, stats, cfg.mode, scaling, load, sensitivity=sensitivity)
            timings[f"svds_{scaling}"] = time.perf_counter() - t1
            ranks = {"uniform": plan.ranks(budget, "uniform"), "load_aware": plan.ranks(budget, "load_aware")}
            uni_bytes = plan.adapter_bytes(ranks["uniform"], itemsize)
            b_same = budget_for_bytes(plan, "load_aware", uni_bytes, itemsize)
            ranks["load_aware_same_bytes"] = plan.ranks(b_same, "load_aware")
            for alloc, r in ranks.items():
                if load != "unit" and alloc == "uniform" and (scaling, "unit") in args.configs:
                    continue  # uniform ignores loads: the same model as (scaling, unit, uniform)
                key = f"{scaling}/{load}/{alloc}"
                t1 = time.perf_counter()
                enc = copy.deepcopy(float_encoder)
                quantize_model(enc, cfg.modules, cfg.mode, plan.adapters(r), cfg.adapter_dtype)
                acc = score(enc)
                timings[f"score_{key}"] = time.perf_counter() - t1
                adapter = plan.adapter_bytes(r, itemsize)
                results.setdefault(key, []).append(
                    {
                        "acc": acc,
                        "rank": sum(r.values()),
                        "adapter_mb": adapter / 2**20,
                        "bpw": 8 * (n_weights * 17 / 32 + adapter) / n_weights,
                        "rel_err": plan.weighted_error(r) / plan.weighted_error(zero),
                    }
                )
                info[key] = {"model_mb": mx_mb + adapter / 2**20}
                del enc
    mean_float, mean_mx = np.mean([float_acc[t] for t in order]), np.mean([mx_acc[t] for t in order])
    lost = mean_float - mean_mx
    head = " ".join(f"{t:>8}" for t in order)
    print()
    print(
        f"{'variant':<34} {head} {'mean':>7} {'spread':>7} {'recov.':>7} {'agree':>6} {'logit err':>9} "
        f"{'rank':>5} {'bits/w':>6} {'adapt MB':>8} {'rel.err':>7}"
    )
    print(f"{'float (merged encoder)':<34} " + " ".join(f"{float_acc[t]:8.3f}" for t in order) + f" {mean_float:7.4f}")
    print(
        f"{'mxfp4':<34} "
        + " ".join(f"{mx_acc[t]:8.3f}" for t in order)
        + f" {mean_mx:7.4f} {'':>7} {0.0:7.2f} {mx_acc['_agree']:6.3f} {mx_acc['_logit_err']:9.4f} "
        f"{0:5d} {4.25:6.2f} {0.0:8.2f} {1.0:7.3f}"
    )
    for key, runs in results.items():
        accs = {t: np.mean([r["acc"][t] for r in runs]) for t in order}
        means = [np.mean([r["acc"][t] for t in order]) for r in runs]
        m = float(np.mean(means))
        spread = (max(means) - min(means)) if len(means) > 1 else float("nan")
        rec = (m - mean_mx) / lost if lost > 0 else float("nan")
        print(
            f"{key:<34} "
            + " ".join(f"{accs[t]:8.3f}" for t in order)
            + f" {m:7.4f} {spread:7.4f} {rec:7.2f} {np.mean([r['acc']['_agree'] for r in runs]):6.3f} "
            f"{np.mean([r['acc']['_logit_err'] for r in runs]):9.4f} {runs[0]['rank']:5d} {runs[0]['bpw']:6.2f} "
            f"{runs[0]['adapter_mb']:8.2f} {np.mean([r['rel_err'] for r in runs]):7.3f}"
        )
    float_mb = merged["paths"]["model.safetensors"].stat().st_size / 2**20
    print()
    print(
        f"# sizes: float merged encoder {float_mb:.1f} MB on disk; MXFP4 encoder {mx_mb:.1f} MB on disk "
        f"(quantized matrices {4 * n_weights / 2**20:.1f} MB float32 -> {n_weights * 17 / 32 / 2**20:.1f} MB MXFP4; "
        f"embeddings and LayerNorms stay float32)"
    )
    print("# recov. = (mean - mxfp4 mean) / (float mean - mxfp4 mean): the share of MXFP4's accuracy loss recovered")
    print(
        "# agree = share of all test items whose predicted label equals the float model's; logit err = mean over "
        "items of |z - z_float| / |z_float|"
    )
    print("# rel.err = weighted compression error of the allocation / MXFP4's (in that scaling's own units)")
    print(
        "# seconds: "
        + ", ".join(
            f"{k} {v:.1f}" for k, v in timings.items() if not k.startswith("score_") or k == "score_float_and_mxfp4"
        )
    )


if __name__ == "__main__":
    main()
