"""MoEfication of the real dense model: SmolLM2-135M-Instruct (the packaged GGUF) -> a Mixtral MoE;
perplexity of dense vs MoE on held-out text, router quality, expert loads and the time of each step.

    .venv/bin/python benchmarks/moe_build_check.py                         # E=8, k=2, bbc_news
    .venv/bin/python benchmarks/moe_build_check.py --experts 8 --top-k 2 --calib 32 --eval 64 --seq-len 128

The corpus's texts are split by a seeded permutation into a calibration half and a held-out half, so
the perplexity is measured on texts the clustering and the routers never saw. The MoE is scored at
its built expert_scale (default top_k) and, for comparison, at expert_scale 1 (the plain Mixtral
combine: renormalised top-k weights times the unscaled experts), by rescaling down_proj in place.
The unit-weight check compares the MoE with every expert selected at unit weight to the dense model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


@contextmanager
def expert_counts(moe):
    """Within the block, count per layer how many (token, slot) pairs each expert receives: [L, E]."""
    counts = torch.zeros(len(moe.model.layers), moe.config.num_local_experts)

    def count(i):
        def hook(router, args, out):  # returns None: the router's output is left as it is
            counts[i].add_(torch.bincount(out[2].flatten(), minlength=counts.shape[1]).float())
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(count(i)) for i, layer in enumerate(moe.model.layers)]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="bbc_news")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--calib", type=int, default=32, help="calibration sequences")
    ap.add_argument("--eval", type=int, default=64, help="held-out sequences")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from crucible.moe.build import all_experts_unit_weight, moefy
    from crucible.moe.dense import load_dense
    from crucible.moe.lm import perplexity, token_sequences
    from tasks.data.corpora import load_corpus

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    dense, tokenizer = load_dense()
    seconds["gguf load (config, tokenizer, dequantize)"] = time.perf_counter() - t0

    texts = load_corpus(args.corpus)["text"].tolist()
    order = np.random.default_rng(args.seed).permutation(len(texts))
    half = len(texts) // 2
    calib = token_sequences(tokenizer, [texts[i] for i in order[:half]], args.seq_len, args.calib, seed=args.seed)
    held = token_sequences(tokenizer, [texts[i] for i in order[half:]], args.seq_len, args.eval, seed=args.seed)

    t0 = time.perf_counter()
    moe, report = moefy(dense, calib, n_experts=args.experts, top_k=args.top_k, seed=args.seed,
                        batch_size=args.batch_size)
    seconds["moefy total"] = time.perf_counter() - t0
    for k, v in report.seconds.items():
        seconds[f"  moefy {k}"] = v

    print(f"# moe_build_check: corpus={args.corpus} E={args.experts} k={args.top_k} seed={args.seed} "
          f"calib={args.calib}x{args.seq_len} held-out={args.eval}x{args.seq_len} threads={torch.get_num_threads()} "
          f"load average {os.getloadavg()[0]:.1f} (timings assume an otherwise idle machine)")
    print()
    print(f"{'model':<48} {'perplexity':>10}")

    def score(name: str, model, key: str | None = None) -> None:
        t0 = time.perf_counter()
        ppl = perplexity(model, held, args.batch_size)
        if key:
            seconds[key] = time.perf_counter() - t0
        print(f"{name:<48} {ppl:10.3f}", flush=True)

    score("dense (GGUF Q4_1 dequantized, float32)", dense, "perplexity dense")
    with expert_counts(moe) as counts:
        score(f"MoE E={args.experts} k={args.top_k}, expert_scale={report.expert_scale:g}", moe, "perplexity MoE")
    loads = (counts / counts.sum(1, keepdim=True)).numpy()
    if report.expert_scale != 1.0:  # the plain Mixtral combine, for comparison
        with torch.no_grad():
            for layer in moe.model.layers:
                layer.mlp.experts.down_proj.div_(report.expert_scale)
        score(f"MoE E={args.experts} k={args.top_k}, expert_scale=1", moe)
        with torch.no_grad():
            for layer in moe.model.layers:
                layer.mlp.experts.down_proj.mul_(report.expert_scale)

    probe = held[:4]
    with torch.no_grad():
        ref = dense(input_ids=probe).logits
        with all_experts_unit_weight(moe):
            unit_err = float((moe(input_ids=probe).logits - ref).abs().max())
    print(f"# all experts at unit weight vs dense: max |logit diff| = {unit_err:.2e} over {probe.numel()} tokens")
    print()
    frame = report.frame()
    frame["held_load_min"], frame["held_load_max"] = loads.min(1), loads.max(1)
    print("# router quality on calibration tokens (chance recall = k/E = "
          f"{args.top_k / args.experts:.3f}); loads on held-out tokens (uniform = {1 / args.experts:.3f})")
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"# mean: recall {frame.recall.mean():.3f}, mass covered {frame.mass_covered.mean():.3f} "
          f"(oracle {frame.oracle_mass.mean():.3f}), r2 {frame.r2.mean():.3f}; held-out load max/min over all "
          f"layers {loads.max():.3f} / {loads.min():.3f}")
    print()
    print(f"{'step':<44} {'seconds':>8}")
    for k, v in seconds.items():
        print(f"{k:<44} {v:8.1f}")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
