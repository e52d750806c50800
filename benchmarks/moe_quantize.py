"""MoE quantization on the SmolLM2 MoE that moe_build makes (shared expert, refit, recovery): MXFP4,
+ uniform compensation, + load-aware compensation with the routed load, + load-aware with the
propagation-aware load (all at one total rank), + replay QAT from the best of these; the shared
expert in MXFP4 and kept float, both measured; over 3 calibration seeds.

    .venv/bin/python benchmarks/moe_quantize.py                    # defaults: under 30 min on 2 cores
    .venv/bin/python benchmarks/moe_quantize.py --seeds 0 --qat-steps 4 --shared quantized   # a quick look

Build (once, fixed): exactly the moe_build stage's steps with params.yaml's `moe:` values and
`pipeline.seed` (shared_share 0.25, 6 experts, top-2, refit_down, moe.recover_steps (100) recovery
steps of the experts at moe.recover_lr on the stage's recovery sequences): crucible.moe.build.moefy,
crucible.moe.refit.refit_down, crucible.moe.recover.recover. The 100 recovery steps take 6 to 12
minutes on 2 cores; `--load-moe DIR` takes the moe_build stage's output instead (after `crucible run
--profile moe`: build/moe/models/moe/build), which keeps the run under 30 minutes (11 on 2 cores).
Data as the stages draw it (tasks.data.moe_text): the texts of
moe.corpora deduplicated and split by content hash (moe.eval_share held out); the build sequences are
the stage's, the held-out sequences the first `--eval-seqs` of the stage's (seed 0). Calibration seed s
draws moe.calib_sequences (`--calib-seqs`) sequences from the calibration pool in the order of derive_seed(s, "moe",
"calib"), as tasks.data.moe_text.sequences does for pipeline seed s (seed 0 is the stage's draw).
Each seed's draw feeds the float routes, the expert statistics, the propagation-aware loads, the
compensation plan, the choice of the QAT start and the replay-QAT data; the QAT batch order is
seeded with s too. float and mxfp4 do not depend on the draw and are evaluated once per setting.

Method: crucible.moe.variants.quantize_variants (the function the moe_quantize stage calls), run
twice per seed: `--shared quantized` (the shared expert's gate/up/down in MXFP4 and compensated like
attention, load 1) and `--shared float` (kept float: neither quantized nor compensated; the rank
budget then covers fewer matrices). Rank budget: `--rank-per-matrix` (8) x the compensated matrices
of the setting, the same total for uniform, load_aware and load_aware_prop. load_aware_prop's load
per matrix is its routed share x the mean squared gradient of the summed next-token loss w.r.t. its
output (crucible.moe.sensitivity; the dense quantize stage's output sensitivity, per expert). Replay
QAT (`--qat-steps`, moe.qat_lr, moe.qat_loss) starts from the compensated variant with the lowest calibration
KL to the float MoE (chosen on the calibration draw, never on the held-out sequences).

Reported per variant against the float MoE, on the held-out sequences, without replay: perplexity
ratio ppl / ppl_float (mean over seeds, max - min, per seed); routing consistency per layer (share of
tokens with the same top-k set, top-1 agreement) averaged over layers, and per layer for the worst
layers; hidden-state drift ||h_l - h_float,l|| / ||h_float,l|| (mean over layers, last layer); bits
per weight. Sizes: crucible.moe.mx_storage.moe_nbytes counts a float parameter at its in-memory
dtype, float32 here; the tables count every float part (embeddings, norms, routers, the
shared-expert gate and, with --shared float, the shared expert) at 2 bytes, as bf16 would store
it: "bpw body" = bits per weight of the matrices quantization may touch (experts, attention, shared
expert: MXFP4 codes + scales + bf16 adapters, or bf16 for a float shared expert), "MiB bf16" = the
whole model with its float parts as bf16. Where the rank went: per allocation the share on expert /
attention / shared matrices, and per layer (with that layer's set agreement and drift).

Size, to stay under 30 minutes on 2 shared cores: the build and the calibration draw (32 sequences
of 64 tokens per seed) are the stage's; the held-out set is the first 32 of the stage's 64 sequences
(`--eval-seqs`; 2,016 scored tokens) and replay QAT runs 16 steps (`--qat-steps`; 4 epochs of the 4
calibration batches of 8 x 64 tokens) where the stage runs 60. The second setting of a seed reuses
the first one's routes, plan and loads (quantize_variants keep_calibration / calibration). The
defaults ran in 25.9 minutes wall (build 4.2 min, one seed of both settings 5.5-8.9 min) on the
2-core machine at a load average of 5 to 7 from other jobs. --threads 1 by default: under that load
one torch thread was measured faster than two (a recovery step 13 s against about 49 s, in separate
runs); pass
--threads 2 on idle cores.
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

import torch  # noqa: E402

ORDER = ("float", "mxfp4", "uniform", "load_aware", "load_aware_prop", "qat")
PER_SEED = ("uniform", "load_aware", "load_aware_prop", "qat")
ALLOCS = ("uniform", "load_aware", "load_aware_prop")
SETTINGS = {"quantized": True, "float": False}  # the quantized setting first: its kept plan covers both


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, max - min)."""
    return statistics.fmean(values), max(values) - min(values)


def table(header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]

    def fmt(cells) -> str:
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


def compare(better: str, worse: str, values: dict[str, list[float]], lower: bool = True) -> tuple[bool, str]:
    """Whether `better` beats `worse` on every seed (paired) and by more than the larger max - min over
    seeds of either; lower is better unless `lower` is False."""
    b, w = values[better], values[worse]
    sign = 1 if lower else -1
    gaps = [sign * (x - y) for x, y in zip(w, b)]  # > 0: `better` wins that seed
    tol = max(spread(b)[1], spread(w)[1])
    paired = all(g > 0 for g in gaps)
    clear = paired and statistics.fmean(gaps) > tol
    return clear, (
        f"per-seed gains {', '.join(f'{g:+.4f}' for g in gaps)}; mean {statistics.fmean(gaps):+.4f} vs "
        f"seed spread {tol:.4f}; better on every seed: {'yes' if paired else 'no'}"
    )


def param_counts(moe) -> dict[str, int]:
    from crucible.moe.mx_experts import quantizable_linears

    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    attention = sum(moe.get_submodule(n).weight.numel() for n in quantizable_linears(moe, True, False, False))
    shared = sum(moe.get_submodule(n).weight.numel() for n in quantizable_linears(moe, False, False, True))
    total = sum(p.numel() for p in {id(p): p for p in moe.parameters()}.values())
    return {"experts": experts, "attention": attention, "shared": shared, "total": total}


def sizes(v: dict, counts: dict[str, int], shared_float: bool) -> dict[str, float]:
    """bpw body and MiB with every float part at 2 bytes (see the module docstring)."""
    b = v["bytes"]
    body_weights = counts["experts"] + counts["attention"] + counts["shared"]
    if "expert_weights" in b and (b["expert_weights"] or b["linear_weights"]):
        body = b["expert_weights"] + b["expert_adapters"] + b["linear_weights"] + b["linear_adapters"]
        body += 2 * counts["shared"] if shared_float else 0
    else:  # the float MoE
        body = 2 * body_weights
    total_bf16 = b["total"] - b["float"] / 2  # moe_nbytes counts the float parts as float32
    return {"bpw_body": 8.0 * body / body_weights, "mib_bf16": total_bf16 / 2**20}


def build(args, log):
    """The MoE exactly as the moe_build stage builds it (params.yaml), its data, timings."""
    from crucible.moe.build import moefy
    from crucible.moe.lm import perplexity, token_sequences
    from crucible.moe.recover import recover
    from crucible.moe.refit import refit_down
    from tasks.data.moe_text import lm_texts, sequences, source_model
    from tasks.runtime.params import load_params

    params = load_params(ROOT / "params.yaml")
    p, seed = params.moe, params.pipeline.seed
    seconds = {}
    t = time.perf_counter()
    dense, tokenizer, source = source_model(p)
    pool, held = lm_texts(p.corpora, p.eval_share)
    stage_seqs = sequences(tokenizer, p, seed, parts=("build", "recover"))  # the stage's draws
    build_ids, recover_ids = stage_seqs["build"], stage_seqs["recover"]
    eval_ids = token_sequences(tokenizer, held, p.seq_len, args.eval_seqs, seed=0)  # the stage's first rows
    seconds["load dense, texts, tokens"] = time.perf_counter() - t
    info = {
        "source": source,
        "n_experts": p.n_experts,
        "top_k": p.top_k,
        "shared_share": p.shared_share,
        "refit": p.refit,
        "refit_ridge": p.refit_ridge,
        "recover": [p.recover_steps, p.recover_train, p.recover_lr],
        "seq_len": p.seq_len,
        "build_sequences": p.build_sequences,
        "recover_sequences": p.recover_sequences,
        "eval_sequences": args.eval_seqs,
        "pipeline_seed": seed,
    }
    if args.load_moe:
        from transformers import AutoModelForCausalLM

        from crucible.moe.dense import tie_embeddings

        t = time.perf_counter()
        moe = tie_embeddings(
            AutoModelForCausalLM.from_pretrained(args.load_moe, local_files_only=True, dtype=torch.float32)
        ).eval()
        seconds["load MoE (--load-moe)"] = time.perf_counter() - t
        info["loaded"] = args.load_moe
    else:
        t = time.perf_counter()
        moe, _ = moefy(
            dense,
            build_ids,
            n_experts=p.n_experts,
            top_k=p.top_k,
            shared_share=p.shared_share,
            seed=seed,
            batch_size=p.batch_size,
            progress=args.progress,
        )
        seconds["moefy"] = time.perf_counter() - t
        t = time.perf_counter()
        if p.refit:
            refit_down(moe, dense, build_ids, ridge=p.refit_ridge)
        seconds["refit_down"] = time.perf_counter() - t
        t = time.perf_counter()
        hist = recover(
            moe,
            dense,
            list(recover_ids.split(p.batch_size)),
            p.recover_steps,
            lr=p.recover_lr,
            train=p.recover_train,
            seed=seed,
            progress=args.progress,
        )
        seconds["recover"] = time.perf_counter() - t
        info["recover_loss"] = [h["loss"] for h in hist]
        if args.save_moe:
            moe.save_pretrained(args.save_moe)
    moe.eval()
    t = time.perf_counter()
    info["perplexity_dense"] = perplexity(dense, eval_ids, p.batch_size)
    seconds["eval dense"] = time.perf_counter() - t
    log(
        f"# build: {source}; E={p.n_experts} top-{p.top_k} shared_share={p.shared_share} refit={p.refit} recovery "
        f"{p.recover_steps} {p.recover_train} steps lr {p.recover_lr:g}; "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    )
    return moe, dense, tokenizer, pool, eval_ids, p, info, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--shared", choices=["both", "quantized", "float"], default="both")
    ap.add_argument("--qat-steps", type=int, default=16, help="replay QAT steps (params.yaml moe.qat_steps: 60)")
    ap.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences (params.yaml moe.eval_sequences: 64)")
    ap.add_argument(
        "--calib-seqs",
        type=int,
        default=None,
        help="calibration sequences per seed (default: params.yaml moe.calib_sequences)",
    )
    ap.add_argument("--rank-per-matrix", type=int, default=8, help="budget = this x the compensated matrices")
    ap.add_argument("--worst", type=int, default=6, help="layers in the worst-layer table")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--load-moe",
        default=None,
        help="the moe_build stage's output folder (models/moe/build) instead of building; it must be built with "
        "params.yaml's moe values",
    )
    ap.add_argument("--save-moe", default=None, help="save the built MoE to this folder")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--json", default=None, help="write every metric to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from crucible.moe.lm import token_sequences
    from crucible.moe.variant_eval import float_reference
    from crucible.moe.variants import compensated_matrices, default_rank_budget, quantize_variants
    from crucible.seeding import derive_seed

    wall = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"# load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")
    moe, dense, tokenizer, pool, eval_ids, p, info, seconds = build(args, log)
    qat_steps = args.qat_steps
    calib_seqs = args.calib_seqs or p.calib_sequences
    counts = param_counts(moe)
    t0 = time.perf_counter()
    reference = float_reference(moe, eval_ids, p.batch_size, args.progress)
    seconds["float reference (eval)"] = time.perf_counter() - t0
    settings = [s for s in SETTINGS if args.shared in ("both", s)]
    runs: dict[str, dict[int, dict]] = {s: {} for s in settings}
    budgets = {}
    for setting in settings:
        budgets[setting] = default_rank_budget(moe, p.attention, args.rank_per_matrix, SETTINGS[setting])
    for i, s in enumerate(args.seeds):
        calib_ids = token_sequences(tokenizer, pool, p.seq_len, calib_seqs, seed=derive_seed(s, "moe", "calib"))
        kept = None  # the routes, plan and loads of this draw, computed once for both settings
        for j, setting in enumerate(settings):
            t0 = time.perf_counter()
            out = quantize_variants(
                moe,
                calib_ids,
                eval_ids,
                rank_budget=budgets[setting],
                attention=p.attention,
                qat_steps=qat_steps,
                qat_lr=p.qat_lr,
                qat_loss=p.qat_loss,
                seed=s,
                batch_size=p.batch_size,
                mode=p.mode,
                progress=args.progress,
                dense=dense if (i == 0 and j == 0) else None,
                reference=reference,
                include_float=i == 0,
                include_mxfp4=i == 0,
                shared=SETTINGS[setting],
                keep_calibration=j < len(settings) - 1,
                calibration=kept,
            )
            kept = out.calibration if kept is None else kept
            runs[setting][s] = out.metrics
            seconds[f"shared {setting}, seed {s}"] = time.perf_counter() - t0
            v = out.metrics["variants"]
            start = f"; QAT from {out.metrics['qat']['start']}" if out.metrics["qat"] else ""
            log(
                f"# shared {setting}, seed {s}: {seconds[f'shared {setting}, seed {s}']:.0f} s; perplexity "
                + ", ".join(f"{k} {x['perplexity']:.2f}" for k, x in v.items())
                + start
            )
            del out
        del kept
    total = time.perf_counter() - wall
    ppl_float = reference.perplexity
    dense_ppl = info["perplexity_dense"]

    log("")
    log(
        f"# moe_quantize: {info['source']} -> Qwen2-MoE E={info['n_experts']} top-{info['top_k']} shared_share "
        f"{info['shared_share']} (refit, {info['recover'][0]} recovery steps); held-out {eval_ids.shape[0]}x"
        f"{eval_ids.shape[1]} tokens, calibration {calib_seqs}x{p.seq_len} per seed, seeds {args.seeds}; "
        f"QAT {qat_steps} steps lr {p.qat_lr:g} ({p.qat_loss}); threads {torch.get_num_threads()}"
    )
    log(
        f"# perplexity: dense {dense_ppl:.3f}, float MoE {ppl_float:.3f} (ratio {ppl_float / dense_ppl:.3f}); "
        f"rank budget "
        + ", ".join(
            f"shared {k}: {b} = {args.rank_per_matrix} x "
            f"{len(compensated_matrices(moe, p.attention, SETTINGS[k]))} matrices"
            for k, b in budgets.items()
        )
    )
    verdicts = {}
    for setting in settings:
        r = runs[setting]
        seeds = list(r)
        first = r[seeds[0]]
        shared_float = not SETTINGS[setting]
        names = [k for k in ORDER if k in first["variants"]]
        ratio = {
            k: [x["variants"][k]["perplexity"] / ppl_float for x in r.values() if k in x["variants"]] for k in names
        }
        agree = {
            k: [x["variants"][k]["consistency_mean"]["set"] for x in r.values() if k in x["variants"]] for k in names
        }

        def mean_of(k, get):
            return statistics.fmean(get(x["variants"][k]) for x in r.values() if k in x["variants"])

        log("")
        log(
            f"## shared expert {'in MXFP4' if SETTINGS[setting] else 'kept float (bf16 in the sizes)'}: "
            "vs the float MoE on the held-out tokens, mean over seeds (max-min over seeds for per-seed variants)"
        )
        rows = []
        for k in names:
            m, sp = spread(ratio[k])
            per = "/".join(f"{x:.3f}" for x in ratio[k]) if k in PER_SEED else "-"
            sz = sizes(first["variants"][k], counts, shared_float and k != "float")
            rows.append(
                [
                    k,
                    f"{m:.3f}",
                    f"{sp:.3f}" if k in PER_SEED else "-",
                    per,
                    f"{mean_of(k, lambda v: v['consistency_mean']['set']):.4f}",
                    f"{mean_of(k, lambda v: v['consistency_mean']['top1']):.4f}",
                    f"{mean_of(k, lambda v: v['drift_mean']):.4f}",
                    f"{mean_of(k, lambda v: v['drift_last']):.4f}",
                    f"{sz['bpw_body']:.3f}",
                    f"{sz['mib_bf16']:.1f}",
                ]
            )
        log(
            table(
                [
                    "variant",
                    "ppl ratio",
                    "max-min",
                    "per seed",
                    "set agr",
                    "top1 agr",
                    "drift mean",
                    "drift last",
                    "bpw body",
                    "MiB bf16",
                ],
                rows,
            )
        )
        sel = [(s, x["selection"]) for s, x in r.items() if x.get("selection")]
        if sel:
            log(
                "# QAT start (lowest calibration KL): "
                + "; ".join(
                    f"seed {s}: {x['start']} ("
                    + ", ".join(f"{k} {c['kl']:.4f}" for k, c in x["candidates"].items())
                    + ")"
                    for s, x in sel
                )
            )
        quant = [k for k in names if k != "float"]
        layers = list(first["variants"][quant[0]]["consistency"])
        worst = sorted(
            range(len(layers)),
            key=lambda li: statistics.fmean(
                statistics.fmean(
                    x["variants"][k]["consistency"][layers[li]]["set"] for x in r.values() if k in x["variants"]
                )
                for k in quant
            ),
        )[: args.worst]
        log(
            f"## the {args.worst} layers with the lowest routing set agreement (mean over the quantized variants); "
            "set / top-1 agreement, mean over seeds"
        )
        rows = [
            [
                f"L{li}",
                *(
                    f"{mean_of(k, lambda v: v['consistency'][layers[li]]['set']):.3f} / "
                    f"{mean_of(k, lambda v: v['consistency'][layers[li]]['top1']):.3f}"
                    for k in quant
                ),
            ]
            for li in sorted(worst)
        ]
        log(table(["layer", *quant], rows))
        log("## where the rank went (mean over seeds): share of the budget on expert / attention / shared matrices")
        rk = [x["ranks"] for x in r.values()]
        rows = []
        for a in ALLOCS:
            if a not in rk[0]["groups"]:
                continue
            g = {
                grp: statistics.fmean(x["groups"][a][grp] for x in rk) / rk[0]["budget"]
                for grp in ("experts", "attention", "shared")
            }
            we = statistics.fmean(x["weighted_error"][a] / x["weighted_error"]["none"] for x in rk)
            wp = (
                statistics.fmean(x["weighted_error_prop"][a] / x["weighted_error_prop"]["none"] for x in rk)
                if "weighted_error_prop" in rk[0]
                else float("nan")
            )
            rows.append(
                [a, f"{g['experts']:.3f}", f"{g['attention']:.3f}", f"{g['shared']:.3f}", f"{we:.3f}", f"{wp:.3f}"]
            )
        log(table(["allocation", "experts", "attention", "shared", "w.err routed (/none)", "w.err prop (/none)"], rows))
        log(
            "## per layer (mean over seeds): rank total | routing set agreement | drift, for uniform / load_aware / "
            "load_aware_prop"
        )
        n_layers = len(rk[0]["layers"]["uniform"])
        allocs = [a for a in ALLOCS if a in rk[0]["layers"]]
        rows = []
        for li in range(n_layers):
            cells = [f"L{li}"]
            cells.append(" / ".join(f"{statistics.fmean(x['layers'][a][li] for x in rk):.0f}" for a in allocs))
            cells.append(" / ".join(f"{mean_of(a, lambda v: v['consistency'][layers[li]]['set']):.3f}" for a in allocs))
            cells.append(" / ".join(f"{mean_of(a, lambda v: v['drift'][f'layers.{li}']):.3f}" for a in allocs))
            rows.append(cells)
        log(table(["layer", "rank", "set agreement", "drift"], rows))
        log("## claims, " + setting + " shared expert")
        checks = [
            ("(a) load_aware beats uniform: perplexity ratio", "load_aware", "uniform", ratio, True),
            ("(a) load_aware beats uniform: set agreement", "load_aware", "uniform", agree, False),
            ("(a') load_aware_prop beats uniform: perplexity ratio", "load_aware_prop", "uniform", ratio, True),
            ("(a') load_aware_prop beats uniform: set agreement", "load_aware_prop", "uniform", agree, False),
            ("(a') load_aware_prop beats load_aware: perplexity ratio", "load_aware_prop", "load_aware", ratio, True),
        ]
        if "qat" in ratio:
            starts = [x["qat"]["start"] for x in r.values()]
            start_ratio = [x["variants"][st]["perplexity"] / ppl_float for x, st in zip(r.values(), starts)]
            start_agree = [x["variants"][st]["consistency_mean"]["set"] for x, st in zip(r.values(), starts)]
            best_comp = [min(x["variants"][a]["perplexity"] for a in allocs) / ppl_float for x in r.values()]
            ratio = {**ratio, "its start": start_ratio, "best compensation": best_comp}
            agree = {**agree, "its start": start_agree}
            checks += [
                ("(b) qat beats its start: perplexity ratio", "qat", "its start", ratio, True),
                ("(b) qat beats its start: set agreement", "qat", "its start", agree, False),
                (
                    "(b) qat beats the best compensation (by held-out ppl): perplexity ratio",
                    "qat",
                    "best compensation",
                    ratio,
                    True,
                ),
            ]
        for title, b, w, vals, lower in checks:
            if b in vals and w in vals and len(vals[b]) > 1:
                ok, text = compare(b, w, vals, lower)
                verdicts[f"{setting}: {title}"] = ok
                log(f"{title}: {'YES' if ok else 'NO'} ({text})")
    log("")
    log("## time (seconds)")
    for k, v in seconds.items():
        log(f"{k:<40} {v:8.1f}")
    log(f"{'total wall':<40} {total:8.1f}")
    log(f"# load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "build": info,
                    "budgets": budgets,
                    "counts": counts,
                    "seconds": seconds,
                    "total_seconds": total,
                    "verdicts": verdicts,
                    "runs": {k: {str(s): m for s, m in v.items()} for k, v in runs.items()},
                },
                indent=1,
                default=float,
            )
        )


if __name__ == "__main__":
    main()
