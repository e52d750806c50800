"""MoE quantization on the SmolLM2 MoE: dense, MoE float, MXFP4, MXFP4 + uniform compensation, MXFP4 +
load-aware compensation (same total rank) and + limited routing replay QAT, over 3 seeds of the
calibration draw; perplexity, routing consistency and hidden drift per layer, size, time of each step.

    .venv/bin/python benchmarks/moe_quantize.py                         # defaults: under 30 min on 2 cores
    .venv/bin/python benchmarks/moe_quantize.py --seeds 0 --eval-seqs 32 --qat-steps 4 --no-qat-uniform

Data: the texts of `--corpora` (default bbc_news + debates_party) are split by text index: index
% 5 == 0 is held out for evaluation, the rest is the calibration pool. The eval sequences are packed
once from the held-out texts (token_sequences seed 0) and are the same for every seed. The MoE is
built once (moefy, E=8, k=2, on a fixed draw from the calibration pool, token_sequences seed 1000;
moefy does not use the per-seed draw). Per seed s the calibration sequences are token_sequences(pool,
seed=s): different texts in a different order. They feed the float routes, the expert statistics,
the compensation plan and the replay-QAT data; the QAT batch order is seeded with s too.
dense / float / mxfp4 do not depend on the calibration draw and are evaluated once.

Method: crucible.moe.variants.quantize_variants (the same function the pipeline stage calls).
Rank budget: `--rank-per-matrix` (default 8) x the number of compensated matrices (every expert's
gate_up and down, attention q/k/v/o), the same total for uniform and load-aware. Replay QAT ("qat")
starts from the load-aware compensated model and trains the expert adapters only; "uniform_qat" is
the same training from the uniform model (--no-qat-uniform skips it).

Size, to stay under 30 minutes on 2 busy cores: 200 eval sequences of 32 tokens (6,400 tokens), 64
calibration sequences of 32 tokens per seed, 24 QAT steps of 8 x 32 tokens (3 epochs of the
calibration batches), all 30 layers trained; every layer is quantized. The eval and calibration
sequences are shorter than SmolLM2's context (perplexity at 32 tokens of context is higher than
at 128) so that 14 evaluation passes, 6 QAT runs and 3 SVD plans fit. --threads 1 by default: on
the shared 2-core machine one torch thread was measured faster than two (a 512 x 576 x 1536 matmul
0.018 s vs 0.036 s; a 384 x 576 float64 SVD 0.06 s vs 0.6-1.0 s); pass --threads 2 on idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ORDER = ("dense", "float", "mxfp4", "uniform", "load_aware", "qat", "uniform_qat")
PER_SEED = ("uniform", "load_aware", "qat", "uniform_qat")


def split_texts(corpora: list[str]) -> tuple[list[str], list[str]]:
    """(calibration pool, held-out texts): text index % 5 == 0 is held out, per corpus."""
    from tasks.data.corpora import load_corpus

    pool, held = [], []
    for name in corpora:
        texts = load_corpus(name)["text"].tolist()
        held += [t for i, t in enumerate(texts) if i % 5 == 0]
        pool += [t for i, t in enumerate(texts) if i % 5 != 0]
    return pool, held


def spread(values: list[float]) -> tuple[float, float, float]:
    """(mean, max - min, sample std) of a list (std 0 for one value)."""
    m = statistics.fmean(values)
    return m, max(values) - min(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(header: list[str], rows: list[list], widths: list[int] | None = None) -> str:
    widths = widths or [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


def beats(better: str, worse: list[str], ppl: dict[str, list[float]]) -> tuple[bool, str]:
    """Whether variant `better` has a lower mean perplexity than each of `worse` by more than the spread
    over seeds (max - min) of either, and whether it is lower on every seed (paired)."""
    ok, parts = True, []
    mb, rb, _ = spread(ppl[better])
    for w in worse:
        mw, rw, _ = spread(ppl[w])
        gap, tol = mw - mb, max(rb, rw)
        paired = all(b < x for b, x in zip(ppl[better], ppl[w]))
        this = gap > tol
        ok &= this
        parts.append(f"vs {w}: mean gap {gap:+.3f} {'>' if this else '<='} spread {tol:.3f} (max-min over seeds); "
                     f"lower on every seed: {'yes' if paired else 'no'}")
    return ok, "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", default="bbc_news,debates_party")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per calibration and eval sequence")
    ap.add_argument("--eval-seqs", type=int, default=200)
    ap.add_argument("--calib-seqs", type=int, default=64)
    ap.add_argument("--moefy-seqs", type=int, default=16)
    ap.add_argument("--moefy-seq-len", type=int, default=128)
    ap.add_argument("--rank-per-matrix", type=int, default=8, help="budget = this x the compensated matrices")
    ap.add_argument("--budget", type=int, default=None, help="total rank (overrides --rank-per-matrix)")
    ap.add_argument("--no-attention", action="store_true", help="leave q/k/v/o in float")
    ap.add_argument("--qat-steps", type=int, default=24)
    ap.add_argument("--qat-lr", type=float, default=1e-3)
    ap.add_argument("--qat-loss", default="kl", choices=["kl", "hidden"])
    ap.add_argument("--no-qat-uniform", action="store_true", help="skip the QAT run from the uniform model")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); see the docstring")
    ap.add_argument("--load-moe", default=None, help="a folder written by save_moe instead of moefy (development)")
    ap.add_argument("--save-moe", default=None, help="save the built MoE to this folder")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--json", default=None, help="write every metric to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from crucible.moe.build import moefy, save_moe
    from crucible.moe.dense import load_dense
    from crucible.moe.lm import token_sequences
    from crucible.moe.variant_eval import float_reference
    from crucible.moe.variants import compensated_matrices, default_rank_budget, quantize_variants

    wall = time.perf_counter()
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    dense, tokenizer = load_dense()
    seconds["load dense (GGUF)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool, held = split_texts(args.corpora.split(","))
    eval_ids = token_sequences(tokenizer, held, args.seq_len, args.eval_seqs, seed=0)
    seconds["texts and tokens"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.load_moe:
        from transformers import AutoModelForCausalLM

        moe = AutoModelForCausalLM.from_pretrained(args.load_moe, local_files_only=True, dtype=torch.float32).eval()
        moefy_info = {"loaded": args.load_moe}
        seconds["load MoE"] = time.perf_counter() - t0
    else:
        moefy_ids = token_sequences(tokenizer, pool, args.moefy_seq_len, args.moefy_seqs, seed=1000)
        moe, report = moefy(dense, moefy_ids, n_experts=args.experts, top_k=args.top_k, seed=0,
                            batch_size=args.batch_size, progress=args.progress)
        seconds["moefy"] = time.perf_counter() - t0
        moefy_info = {"seconds": report.seconds, "expert_scale": report.expert_scale,
                      "layers": report.frame().to_dict(orient="list")}
        if args.save_moe:
            save_moe(moe, args.save_moe, tokenizer, report)
    attention = not args.no_attention
    n_matrices = len(compensated_matrices(moe, attention))
    budget = args.budget if args.budget is not None else default_rank_budget(moe, attention, args.rank_per_matrix)

    runs, reference = {}, None
    t0 = time.perf_counter()
    reference = float_reference(moe, eval_ids, args.batch_size, args.progress)
    seconds["float reference (eval)"] = time.perf_counter() - t0
    for i, s in enumerate(args.seeds):
        calib_ids = token_sequences(tokenizer, pool, args.seq_len, args.calib_seqs, seed=s)
        t0 = time.perf_counter()
        out = quantize_variants(moe, calib_ids, eval_ids, rank_budget=budget, attention=attention,
                                qat_steps=args.qat_steps, qat_lr=args.qat_lr, qat_loss=args.qat_loss, seed=s,
                                batch_size=args.batch_size, progress=args.progress, dense=dense if i == 0 else None,
                                reference=reference, include_float=i == 0, include_mxfp4=i == 0,
                                qat_uniform=not args.no_qat_uniform)
        runs[s] = out.metrics
        seconds[f"quantize_variants seed {s}"] = time.perf_counter() - t0
        v = out.metrics["variants"]
        print(f"# seed {s} done in {seconds[f'quantize_variants seed {s}']:.0f} s: "
              + ", ".join(f"{k} {x['perplexity']:.3f}" for k, x in v.items()), flush=True)
        if i == 0:
            del dense  # only the first call scores it
            dense = None
        del out
    total = time.perf_counter() - wall

    first = runs[args.seeds[0]]
    variants = [k for k in ORDER if any(k in r["variants"] for r in runs.values())]
    per_seed = [k for k in variants if k in PER_SEED]
    ppl = {k: [r["variants"][k]["perplexity"] for r in runs.values() if k in r["variants"]] for k in variants}

    print(f"# moe_quantize: corpora={args.corpora} E={moe.config.num_local_experts} k={moe.config.num_experts_per_tok} "
          f"seeds={args.seeds} eval={args.eval_seqs}x{args.seq_len} calib={args.calib_seqs}x{args.seq_len} "
          f"moefy calib={args.moefy_seqs}x{args.moefy_seq_len} (fixed draw) threads={torch.get_num_threads()}")
    print(f"# rank budget {budget} = {budget / n_matrices:g} x {n_matrices} compensated matrices "
          f"(expert gate_up/down{', attention q/k/v/o' if attention else ''}); QAT {args.qat_steps} steps, "
          f"lr {args.qat_lr:g}, loss {args.qat_loss}, from load_aware{'' if args.no_qat_uniform else ' (qat) and from uniform (uniform_qat)'}, "
          f"batches of {args.batch_size} x {args.seq_len}")
    print()
    print("## perplexity on the held-out sequences (dense/float/mxfp4 do not depend on the calibration draw)")
    rows = []
    for k in variants:
        vals = ppl[k]
        m, r, sd = spread(vals)
        cells = [f"{x:.3f}" for x in vals] if k in per_seed else [f"{vals[0]:.3f}"] + ["-"] * (len(args.seeds) - 1)
        rows.append([k, *cells, f"{m:.3f}", f"{r:.3f}" if k in per_seed else "-", f"{sd:.3f}" if k in per_seed else "-"])
    print(table(["variant", *[f"seed {s}" for s in args.seeds], "mean", "max-min", "std"], rows))
    print()
    print("## vs the float MoE on the eval tokens, mean over seeds: next-token argmax agreement, routing consistency "
          "(own routing, no replay; set and top-1 agreement, mean over layers), hidden drift (mean over layers, last "
          "layer); size")
    rows = []
    for k in variants:
        if k == "dense":
            continue
        rs = [r["variants"][k] for r in runs.values() if k in r["variants"]]
        b = rs[0]["bytes"]
        rows.append([k, f"{statistics.fmean(x['token_agreement'] for x in rs):.4f}",
                     f"{statistics.fmean(x['consistency_mean']['set'] for x in rs):.4f}",
                     f"{statistics.fmean(x['consistency_mean']['top1'] for x in rs):.4f}",
                     f"{statistics.fmean(x['drift_mean'] for x in rs):.4f}",
                     f"{statistics.fmean(x['drift_last'] for x in rs):.4f}",
                     f"{b['total'] / 2**20:.2f}", f"{(b['expert_adapters'] + b['linear_adapters']) / 2**20:.2f}",
                     f"{rs[0]['bits_per_weight']:.3f}", f"{rs[0]['bits_per_weight_detail']['experts_with_adapters']:.3f}"])
    print(table(["variant", "token agr", "set agr", "top1 agr", "drift mean", "drift last", "MiB", "adapter MiB", "bpw model",
                 "bpw experts+ad"], rows))
    if "dense" in first["variants"]:
        print(f"# dense: {first['variants']['dense']['bytes']['total'] / 2**20:.2f} MiB float32")
    print()
    quant = [k for k in variants if k not in ("dense", "float")]
    layers = list(first["variants"][quant[0]]["consistency"])
    for title, get in (("routing set agreement", lambda x, li, layer: x["consistency"][layer]["set"]),
                       ("routing top-1 agreement", lambda x, li, layer: x["consistency"][layer]["top1"]),
                       ("hidden drift ||h - h_float|| / ||h_float||", lambda x, li, layer: x["drift"][f"layers.{li}"])):
        print(f"## per layer, mean over seeds: {title}")
        rows = []
        for li, layer in enumerate(layers):
            cells = [layer.replace("model.layers.", "L").replace(".mlp", "")]
            for k in quant:
                rs = [r["variants"][k] for r in runs.values() if k in r["variants"]]
                cells.append(f"{statistics.fmean(get(x, li, layer) for x in rs):.3f}")
            rows.append(cells)
        print(table(["layer", *quant], rows))
        print()
    print("## ranks (load-aware vs uniform, same total), mean over seeds")
    rows = []
    for s, r in runs.items():
        rk = r["ranks"]
        mats = rk["matrices"]
        ex = [m for m in mats if m["expert"] is not None]
        load = np.array([m["load"] for m in ex])
        la = np.array([m["load_aware"] for m in ex])
        corr = float(np.corrcoef(load, la)[0, 1]) if la.std() > 0 and load.std() > 0 else float("nan")
        att = [m["load_aware"] for m in mats if m["expert"] is None]
        rows.append([s, f"{rk['experts_share']['uniform']:.3f}", f"{rk['experts_share']['load_aware']:.3f}",
                     f"{int(la.min())}-{int(la.max())}", f"{statistics.fmean(att) if att else 0:.1f}",
                     f"{corr:+.3f}", f"{load.min():.3f}-{load.max():.3f}",
                     f"{rk['weighted_error']['none']:.4g}", f"{rk['weighted_error']['uniform']:.4g}",
                     f"{rk['weighted_error']['load_aware']:.4g}"])
    print(table(["seed", "expert share U", "expert share LA", "LA expert ranks", "LA attn mean", "corr(load, LA rank)",
                 "expert loads", "w.err none", "w.err U", "w.err LA"], rows))
    if first.get("qat"):
        print("# QAT loss (KL to float, calibration batches) first -> last step: " + ", ".join(
            f"seed {s}: {r['qat']['loss_first']:.4f} -> {r['qat']['loss_last']:.4f}" for s, r in runs.items()))
    print()
    print("## time of each step (seconds)")
    steps = list(dict.fromkeys(k for r in runs.values() for k in r["seconds"]))  # seed 0's order, then any new
    rows = [[k, *[f"{r['seconds'][k]:.1f}" if k in r["seconds"] else "-" for r in runs.values()]] for k in steps]
    print(table(["step (quantize_variants)", *[f"seed {s}" for s in args.seeds]], rows))
    for k, v in seconds.items():
        print(f"{k:<40} {v:8.1f}")
    print(f"{'total wall':<40} {total:8.1f}")
    print()
    verdicts = {}
    if len(args.seeds) > 1 and {"uniform", "load_aware"} <= set(ppl):
        ok, text = beats("load_aware", ["uniform"], ppl)
        verdicts["load_aware_beats_uniform"] = ok
        print(f"load-aware beats uniform by more than the seed spread: {'YES' if ok else 'NO'} ({text})")
    if len(args.seeds) > 1 and {"qat", "uniform", "load_aware"} <= set(ppl):
        ok, text = beats("qat", ["uniform", "load_aware"], ppl)
        verdicts["qat_beats_both"] = ok
        print(f"replay QAT beats both by more than the seed spread: {'YES' if ok else 'NO'} ({text})")
    if len(args.seeds) > 1 and {"uniform_qat", "uniform", "load_aware"} <= set(ppl):
        ok, text = beats("uniform_qat", ["uniform", "load_aware"], ppl)
        verdicts["uniform_qat_beats_both"] = ok
        print(f"replay QAT from uniform beats both by more than the seed spread: {'YES' if ok else 'NO'} ({text})")
    if len(args.seeds) > 1 and {"uniform_qat", "qat"} <= set(ppl):
        ok, text = beats("qat", ["uniform_qat"], ppl)
        verdicts["qat_from_load_aware_beats_qat_from_uniform"] = ok
        print(f"QAT from load-aware beats QAT from uniform by more than the seed spread: {'YES' if ok else 'NO'} ({text})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "budget": budget, "matrices": n_matrices,
                                               "seconds": seconds, "total_seconds": total, "verdicts": verdicts,
                                               "moefy": moefy_info, "runs": {str(s): r for s, r in runs.items()}},
                                              indent=1, default=float))


if __name__ == "__main__":
    main()
