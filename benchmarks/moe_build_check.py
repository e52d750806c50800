"""A usable MoE from SmolLM2-135M-Instruct (the packaged GGUF): perplexity against the dense model as a
curve of the active FFN share, built (training-free), after the least-squares refit of the down
projections, and after a short distillation recovery.

    .venv/bin/python benchmarks/moe_build_check.py --recover-eval-every 50   # 25 and 50 % active: ~20 min at 100 steps
    .venv/bin/python benchmarks/moe_build_check.py --points 0.125:7:1,0.25:6:1,0.25:6:2,0.25:6:4   # + 37.5, 75 %: ~1 h
    .venv/bin/python benchmarks/moe_build_check.py --points 0.25:6:2 --recover-steps 4 --eval 16

A point is shared_share:n_experts:top_k; a token uses shared_share + (1 - shared_share) * top_k /
n_experts of the FFN. Points with the same shared_share and n_experts share one build (the same
shared expert, experts and routers; crucible.moe.build.set_top_k changes k). Per point, on the
held-out sequences: perplexity of the MoE as built, after refit_down (crucible.moe.refit), and after
`--recover-steps` steps of crucible.moe.recover (`--recover-train`: router | experts) from the
refitted model (its batches from `--recover-seqs` sequences of their own; `--recover-eval-every N`
adds the held-out perplexity every N steps, the recovery curve); the unit-weight check of each build
(every expert selected at unit weight = dense).

Data as the moe stages use it (tasks.data.moe_text): the texts of bbc_news and debates_party,
deduplicated and split by content hash, `--eval-share` held out. Calibration: `--calib` sequences
of `--seq-len` tokens from the calibration pool (the clustering, routers, refit and the recovery's
batches); held-out: `--eval` sequences of `--seq-len` tokens. --threads 2 by default.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from crucible.moe.recover import TRAIN  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="0.125:7:1,0.25:6:2", help="comma-separated shared_share:n_experts:top_k")
    ap.add_argument("--corpora", default="bbc_news,debates_party")
    ap.add_argument("--eval-share", type=float, default=0.3)
    ap.add_argument("--calib", type=int, default=32, help="calibration sequences")
    ap.add_argument("--eval", type=int, default=64, help="held-out sequences")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--ridge", type=float, default=None, help="refit_down's ridge (default: params.yaml's moe.refit_ridge)"
    )
    ap.add_argument("--recover-steps", type=int, default=None, help="default: params.yaml's moe.recover_steps")
    ap.add_argument(
        "--recover-seqs",
        type=int,
        default=None,
        help="sequences the recovery's batches come from (default: params.yaml's moe.recover_sequences)",
    )
    ap.add_argument("--recover-eval-every", type=int, default=0, help="held-out perplexity every N recovery steps")
    ap.add_argument("--recover-train", default=None, choices=TRAIN, help="default: params.yaml's moe.recover_train")
    ap.add_argument("--recover-lr", type=float, default=None, help="default: params.yaml's moe.recover_lr")
    ap.add_argument("--recover-batch", type=int, default=4, help="sequences per recovery step")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from tasks.runtime.params import load_params

    defaults = load_params(ROOT / "params.yaml").moe
    for arg, name in (
        ("ridge", "refit_ridge"),
        ("recover_steps", "recover_steps"),
        ("recover_seqs", "recover_sequences"),
        ("recover_lr", "recover_lr"),
        ("recover_train", "recover_train"),
    ):
        if getattr(args, arg) is None:
            setattr(args, arg, getattr(defaults, name))
    torch.set_num_threads(args.threads)

    from crucible.moe.build import active_share, all_experts_unit_weight, moefy, set_top_k
    from crucible.moe.dense import load_dense
    from crucible.moe.lm import perplexity, token_sequences
    from crucible.moe.recover import recover
    from crucible.moe.refit import refit_down
    from tasks.data.models import smollm2_gguf_path
    from tasks.data.moe_text import lm_texts

    points = []
    for spec in args.points.split(","):
        share, e, k = spec.split(":")
        points.append((float(share), int(e), int(k)))
    t_start = time.perf_counter()
    dense, tokenizer = load_dense(smollm2_gguf_path())
    pool, held_texts = lm_texts(args.corpora.split(","), args.eval_share)
    calib = token_sequences(tokenizer, pool, args.seq_len, args.calib, seed=1000 + args.seed)
    held = token_sequences(tokenizer, held_texts, args.seq_len, args.eval, seed=0)
    rec_ids = token_sequences(tokenizer, pool, args.seq_len, args.recover_seqs, seed=2000 + args.seed)
    print(
        f"# moe_build_check: SmolLM2-135M-Instruct, corpora={args.corpora}, calib={args.calib}x{args.seq_len}, "
        f"held-out={args.eval}x{args.seq_len}, seed={args.seed}, ridge={args.ridge}, recovery "
        f"{args.recover_steps} steps ({args.recover_train}, lr {args.recover_lr:g}, {args.recover_batch} sequences "
        f"a step, from {args.recover_seqs} sequences), threads={torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    t0 = time.perf_counter()
    ppl_dense = perplexity(dense, held, args.batch_size)
    print(f"# dense perplexity {ppl_dense:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    header = (
        f"{'shared':>6} {'E':>2} {'k':>2} {'active':>6} {'built':>9} {'x dense':>7} {'refit':>9} {'x dense':>7} "
        f"{'recovered':>9} {'x dense':>7} {'active mass':>11} {'seconds':>22}"
    )
    print(header, flush=True)
    builds: dict[tuple, tuple] = {}
    rows = []
    for share, e, k in points:
        key = (share, e)
        if key not in builds:
            t0 = time.perf_counter()
            moe, report = moefy(
                dense, calib, n_experts=e, top_k=k, shared_share=share, seed=args.seed, batch_size=args.batch_size
            )
            with torch.no_grad(), all_experts_unit_weight(moe):
                unit = float((moe(input_ids=held[:2]).logits - dense(input_ids=held[:2]).logits).abs().max())
            builds[key] = (moe, report, unit, time.perf_counter() - t0)
            print(
                f"# build shared={share:g} E={e}: {time.perf_counter() - t0:.0f} s, all experts at unit weight vs "
                f"dense max |logit diff| {unit:.1e}",
                flush=True,
            )
        built, report, unit, build_s = builds[key]
        moe = set_top_k(copy.deepcopy(built), k)
        seconds = {}
        t0 = time.perf_counter()
        ppl_built = perplexity(moe, held, args.batch_size)
        seconds["eval"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        refit = refit_down(moe, dense, calib, ridge=args.ridge)
        seconds["refit"] = time.perf_counter() - t0
        ppl_refit = perplexity(moe, held, args.batch_size)
        t0 = time.perf_counter()
        curve, paused = [], [0.0]

        def at_step(record, step, moe=moe, curve=curve, paused=paused):
            if args.recover_eval_every and step % args.recover_eval_every == 0 and step < args.recover_steps:
                t_eval = time.perf_counter()
                curve.append((step, perplexity(moe, held, args.batch_size)))
                paused[0] += time.perf_counter() - t_eval

        recover(
            moe,
            dense,
            list(rec_ids.split(args.recover_batch)),
            args.recover_steps,
            lr=args.recover_lr,
            train=args.recover_train,
            seed=args.seed,
            progress=False,
            log=at_step,
        )
        seconds["recover"] = time.perf_counter() - t0 - paused[0]
        ppl_rec = perplexity(moe, held, args.batch_size) if args.recover_steps else ppl_refit
        mass = sum(r.active_mass for r in report.layers) / len(report.layers) if k == report.top_k else float("nan")
        act = active_share(e, k, report.shared_share)
        timing = f"ref {seconds['refit']:.0f} rec {seconds['recover']:.0f} ev {seconds['eval']:.0f}"
        print(
            f"{share:6.3f} {e:2d} {k:2d} {act:6.3f} {ppl_built:9.2f} {ppl_built / ppl_dense:7.2f} {ppl_refit:9.2f} "
            f"{ppl_refit / ppl_dense:7.2f} {ppl_rec:9.2f} {ppl_rec / ppl_dense:7.2f} {mass:11.3f} {timing:>22}",
            flush=True,
        )
        if curve:
            print(
                f"#   recovery curve (step: perplexity, x dense): 0: {ppl_refit:.2f} ({ppl_refit / ppl_dense:.2f}x), "
                + ", ".join(f"{s}: {v:.2f} ({v / ppl_dense:.2f}x)" for s, v in curve)
                + f", {args.recover_steps}: {ppl_rec:.2f} ({ppl_rec / ppl_dense:.2f}x)",
                flush=True,
            )
        rows.append((act, ppl_built, ppl_refit, ppl_rec, [r["after"] / max(r["before"], 1e-30) for r in refit]))
    print()
    for act, _, _, _, ratios in rows:
        print(
            f"# active {act:.3f}: refit error after/before per layer min {min(ratios):.3f} "
            f"median {sorted(ratios)[len(ratios) // 2]:.3f} max {max(ratios):.3f}"
        )
    print(f"# total {time.perf_counter() - t_start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
