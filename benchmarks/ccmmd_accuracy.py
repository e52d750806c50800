"""Accuracy of CC-MMD against the oracle as contamination grows, beside naive and audit-only.

    python benchmarks/ccmmd_accuracy.py                        # synthetic Gaussians
    python benchmarks/ccmmd_accuracy.py --embeddings emb.npy   # real embeddings (.npy or .parquet)
    python benchmarks/ccmmd_accuracy.py --task-dir data/rotten  # a demo task after `crucible run`

For each eps in --eps, one fixed pool is drawn (the oracle is a property of that pool), then
--draws independent Poisson audits (inclusion probability --pi). Per estimator it prints bias and
RMSE against the oracle over the audit draws, and the coverage of CC-MMD's delta-method 95 %
interval. Proxy scores are informative but noisy: sigmoid(a (2 M - 1) + noise).

Synthetic: reference ~ N(0, I_d); clean pool ~ N(0.3 e_1, I_d) (so the target MMD is not 0);
contaminants ~ N(1.5 e_1 + 0.5 e_2, I_d). Real embeddings: the rows are shuffled and split into
reference and clean pool; contaminants are rows of --contaminants, or, if none is given, rows
whose columns were permuted independently (same marginals, no joint structure).
--task-dir: a demo task's real embeddings (stage embed) and truth (stage ingest): the reference is
the task's reference; clean items are the pool's true members and the test set; contaminants are
the pool's true contaminants (other corpora, boilerplate, near-duplicates, shuffled text); the
proxy is the pipeline's own cross-fitted domain classifier, fitted once per fixed pool.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from crucible.ccmmd import GaussianKernel, cc_mmd


def load(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path).astype(np.float32)
    import pandas as pd

    df = pd.read_parquet(path)
    col = df.columns[0] if len(df.columns) == 1 else None
    if col is not None and df[col].dtype == object:  # a list-valued embedding column
        return np.stack(df[col].to_numpy()).astype(np.float32)
    return df.select_dtypes("number").to_numpy(np.float32)


def make_pool(eps, args, rng, real=None, contam=None):
    n, m, d = args.n, args.m, args.dim
    member = (rng.random(n) >= eps).astype(float)
    if real is None:
        x = rng.standard_normal((m, d))
        y = rng.standard_normal((n, d))
        y[:, 0] += np.where(member == 1, 0.3, 1.5)
        y[:, 1] += np.where(member == 1, 0.0, 0.5)
    else:
        idx = rng.permutation(len(real))
        x, clean = real[idx[:m]], real[idx[m : m + n]]
        if contam is None:
            src = real[rng.integers(0, len(real), size=(n, real.shape[1])), np.arange(real.shape[1])]
        else:
            src = contam[rng.integers(0, len(contam), n)]
        y = np.where(member[:, None] == 1, clean, src)
    logit = args.signal * (2 * member - 1) + args.noise * rng.standard_normal(n)
    s = 1 / (1 + np.exp(-logit))
    return x, y, member, s


def load_task(task_dir: str):
    """(reference, clean, contaminants) embeddings of a demo task, as float32 arrays."""
    from pathlib import Path

    import pandas as pd
    from safetensors.torch import load_file

    base = Path(task_dir)
    emb = load_file(str(base / "embeddings.safetensors"))
    pool = pd.read_parquet(base / "pool.parquet")
    truth = pd.read_parquet(base / "truth.parquet").set_index("id").loc[pool["id"]]
    member = truth["member"].to_numpy() == 1
    y = emb["pool"].numpy()
    clean = np.vstack([y[member], emb["test"].numpy()])
    return emb["reference"].numpy(), clean, y[~member]


def make_task_pool(eps, args, rng, task):
    from crucible.membership_scores import domain_classifier_scores

    x, clean, contam = task
    n = args.n
    member = (rng.random(n) >= eps).astype(float)
    k_clean, k_cont = int(member.sum()), int(n - member.sum())
    if k_clean > len(clean) or k_cont > len(contam):
        raise SystemExit(
            f"--n {n} at eps {eps} needs {k_clean} clean and {k_cont} contaminant items; the task "
            f"has {len(clean)} and {len(contam)}: lower --n"
        )
    y = np.empty((n, x.shape[1]), dtype=np.float32)
    y[member == 1] = clean[rng.permutation(len(clean))[:k_clean]]
    y[member == 0] = contam[rng.permutation(len(contam))[:k_cont]]
    s = domain_classifier_scores(x.astype(np.float64), y.astype(np.float64), folds=5, seed=args.seed)
    return x, y, member, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", default="0,0.1,0.2,0.3,0.4,0.5")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--n", type=int, default=1000, help="pool size")
    ap.add_argument("--m", type=int, default=500, help="reference size")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--pi", type=float, default=0.1)
    ap.add_argument("--signal", type=float, default=1.0, help="logit separation of the proxy")
    ap.add_argument("--noise", type=float, default=1.5, help="logit noise sd of the proxy")
    ap.add_argument("--embeddings", help=".npy or .parquet of real embeddings (rows = items)")
    ap.add_argument("--contaminants", help="optional .npy/.parquet of contaminant embeddings")
    ap.add_argument("--task-dir", help="a demo task's data folder (embeddings.safetensors, pool, truth)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    real = load(args.embeddings) if args.embeddings else None
    contam = load(args.contaminants) if args.contaminants else None
    task = load_task(args.task_dir) if args.task_dir else None
    if task is not None:
        args.m = len(task[0])
    if real is not None:
        args.n = min(args.n, len(real) - args.m)
    print(
        f"pool n={args.n} reference m={args.m} pi={args.pi} draws={args.draws} "
        + (
            "proxy=cross-fitted domain classifier "
            if task is not None
            else f"proxy=sigmoid({args.signal}(2M-1) + N(0,{args.noise}^2)) "
        )
        + f"data={args.task_dir or args.embeddings or 'synthetic d=%d' % args.dim}"
    )
    print(
        f"{'eps':>4} {'oracle':>8} | {'naive bias':>10} {'rmse':>8} | {'audit bias':>10} {'rmse':>8} | "
        f"{'ccmmd bias':>10} {'rmse':>8} | {'cover':>5} {'mean se':>8} {'sd':>8} | {'eps_hat':>7}"
    )
    t0 = time.time()
    for eps in [float(e) for e in args.eps.split(",")]:
        rng = np.random.default_rng([args.seed, int(eps * 1000)])
        if task is not None:
            x, y, member, s = make_task_pool(eps, args, rng, task)
        else:
            x, y, member, s = make_pool(eps, args, rng, real, contam)
        kernel = GaussianKernel(bandwidths=GaussianKernel().resolve(*map(_t, (x, y))))
        pi = np.full(args.n, args.pi)
        rows = []
        for _ in range(args.draws):
            i = (rng.random(args.n) < pi).astype(float)
            if not (i * member).any():
                continue
            r = cc_mmd(x, y, s, i, np.where(i == 1, member, np.nan), pi, truth=member, kernel=kernel)
            rows.append((r.naive, r.audit_only, r.value, r.se, r.ci_low <= r.oracle <= r.ci_high, r.eps_hat))
        a = np.array(rows, dtype=float)
        o = r.oracle

        def br(col):
            e = a[:, col] - o
            return np.nanmean(e), np.sqrt(np.nanmean(e**2))

        (nb, nr), (ab, ar), (cb, cr) = br(0), br(1), br(2)
        print(
            f"{eps:>4.1f} {o:>8.5f} | {nb:>10.5f} {nr:>8.5f} | {ab:>10.5f} {ar:>8.5f} | "
            f"{cb:>10.5f} {cr:>8.5f} | {a[:, 4].mean():>5.3f} {a[:, 3].mean():>8.5f} "
            f"{a[:, 2].std():>8.5f} | {a[:, 5].mean():>7.3f}",
            flush=True,
        )
    print(
        f"({time.time() - t0:.0f} s; bias and rmse against the oracle MMD^2 of each fixed pool; "
        "cover = share of draws whose 95 % interval contains the oracle; sd = sd of CC-MMD over draws)"
    )


def _t(a):
    import torch

    return torch.as_tensor(a)


if __name__ == "__main__":
    main()
