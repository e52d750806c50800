"""Continual merging: time, peak memory and own-subspace reconstruction as tasks accumulate.

    python benchmarks/merge_scaling.py                       # scaling 1, 2, 4, 8 tasks + quality
    python benchmarks/merge_scaling.py --tasks 1,2,3,4,5,6,7,8 --methods gs3r,opcm

A synthetic transformer-shaped state dict (crucible.merge keys, float32): `--layers` blocks of four
d x d attention matrices, a 4d x d and a d x 4d MLP matrix, their biases and two LayerNorms, plus a
token-embedding matrix (excluded from the subspace methods by name). Task t's task vector is, per
matrix, P_t diag(S_t) Q_t^T (rank `--rank`, random orthonormal P_t, Q_t, S_t decaying from 1 to
0.3) plus dense noise of relative Frobenius norm `--noise`; other parameters get small dense noise.
Task vectors are generated lazily from (seed, t), so only one is alive at a time.

Scaling: each (method, number of tasks) runs in a fresh subprocess; merge_sequence is run over the
tasks (add + merged() after each arrival); it reports the time in add and in merged(), the peak RSS
(ru_maxrss) minus the RSS after theta_0 was built, and the bytes of the merger's state tensors.

Quality: after all arrivals, per task t and matrix, ||P_t^T (merged - theta_0) Q_t - S_t|| / ||S_t||
(how well each task survives on its own subspace), averaged over matrices; mean over tasks, the
worst task and the first task. Two task families: clean (rank-r, random subspaces) and hard
(noise, and 2 of each task's r directions drawn from a subspace shared by all tasks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from crucible.merge import MERGERS, make_merger, merge_sequence  # noqa: E402

DEFAULT_METHODS = ",".join(list(MERGERS) + ["gs3r:energy=0.99"])


def build(label: str):
    """A merger from 'name' or 'name:key=value,...' (values parsed as int, float or str)."""
    name, _, rest = label.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(";")):
        k, v = item.split("=")
        for cast in (int, float, str):
            try:
                kwargs[k] = cast(v)
                break
            except ValueError:
                pass
    return make_merger(name, **kwargs)


def shapes(layers: int, d: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"embeddings.word_embeddings.weight": (1000, d)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out[p + name + ".weight"], out[p + name + ".bias"] = (d, d), (d,)
        out[p + "intermediate.dense.weight"], out[p + "intermediate.dense.bias"] = (4 * d, d), (4 * d,)
        out[p + "output.dense.weight"], out[p + "output.dense.bias"] = (d, 4 * d), (d,)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[p + ln + ".weight"], out[p + ln + ".bias"] = (d,), (d,)
    return out


def is_low_rank(name: str, shape) -> bool:
    return len(shape) == 2 and "embed" not in name


def task_factors(name: str, shape, t: int, rank: int, shared: int, seed: int):
    """P_t (m, r), S_t (r,), Q_t (n, r) of task t on one matrix; `shared` directions common to all."""
    m, n = shape
    key = (seed * 1_000_003 + zlib.crc32(name.encode()) % 100_003) * 101
    g = torch.Generator().manual_seed(key + t + 1)
    gs = torch.Generator().manual_seed(key)  # the subspace shared by every task
    own_p, own_q = torch.randn(m, rank - shared, generator=g), torch.randn(n, rank - shared, generator=g)
    if shared:
        own_p = torch.cat([torch.randn(m, shared, generator=gs), own_p], 1)
        own_q = torch.cat([torch.randn(n, shared, generator=gs), own_q], 1)
    P, _ = torch.linalg.qr(own_p)
    Q, _ = torch.linalg.qr(own_q)
    S = torch.linspace(1.0, 0.3, rank)
    return P, S, Q


def make_task(spec, t: int, rank: int, noise: float, shared: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed * 7919 + t)
    tv = {}
    for name, shape in spec.items():
        if is_low_rank(name, shape):
            P, S, Q = task_factors(name, shape, t, rank, shared, seed)
            x = (P * S) @ Q.T
            if noise:
                x += torch.randn(shape, generator=g) * (noise * float(S.norm()) / (shape[0] * shape[1]) ** 0.5)
            tv[name] = x
        else:
            tv[name] = 0.01 * torch.randn(shape, generator=g)
    return tv


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(method: str, n_tasks: int, args) -> dict:
    torch.set_num_threads(1)
    spec = shapes(args.layers, args.dim)
    g = torch.Generator().manual_seed(0)
    theta_0 = {k: torch.randn(s, generator=g) * 0.02 for k, s in spec.items()}
    base = rss_mb()
    merger = build(method)
    t_add = t_merge = 0.0

    def tasks():
        for t in range(n_tasks):
            yield make_task(spec, t, args.rank, args.noise, 0, args.seed)

    it = iter(tasks())
    for t in range(n_tasks):
        tv = next(it)
        t0 = time.perf_counter()
        merger.add(tv)
        t_add += time.perf_counter() - t0
        del tv
        t0 = time.perf_counter()
        merged = merger.merged(theta_0)
        t_merge += time.perf_counter() - t0
        del merged
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model_mb = sum(x.numel() * 4 for x in theta_0.values()) / 2**20
    return {
        "method": method,
        "tasks": n_tasks,
        "add_s": t_add,
        "merged_s": t_merge,
        "peak_extra_mb": peak - base,
        "state_mb": merger.state_bytes() / 2**20,
        "model_mb": model_mb,
    }


def quality(method: str, args, noise: float, shared: int) -> dict:
    torch.set_num_threads(1)
    spec = shapes(args.quality_layers, args.dim)
    theta_0 = {k: torch.zeros(s) for k, s in spec.items()}
    merger = build(method)
    tvs = (make_task(spec, t, args.rank, noise, shared, args.seed) for t in range(args.quality_tasks))
    for merged in merge_sequence(theta_0, tvs, merger):
        pass
    errs = []
    for t in range(args.quality_tasks):
        per = []
        for name, shape in spec.items():
            if not is_low_rank(name, shape):
                continue
            P, S, Q = task_factors(name, shape, t, args.rank, shared, args.seed)
            got = P.T @ (merged[name] - theta_0[name]) @ Q
            per.append(float(torch.linalg.norm(got - torch.diag(S)) / torch.linalg.norm(S)))
        errs.append(sum(per) / len(per))
    return {"mean": sum(errs) / len(errs), "worst": max(errs), "first": errs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="name or name:k=v;k=v, comma-separated")
    ap.add_argument("--tasks", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quality-layers", type=int, default=2)
    ap.add_argument("--quality-tasks", type=int, default=8)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--case", nargs=2, metavar=("METHOD", "TASKS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args)))
        return
    methods = args.methods.split(",")
    os.environ["OMP_NUM_THREADS"] = "1"

    if not args.skip_scaling:
        spec = shapes(args.layers, args.dim)
        print(
            f"scaling: {args.layers} layers, d={args.dim}, "
            f"{sum(torch.Size(s).numel() for s in spec.values()) / 1e6:.1f}M params, task rank "
            f"{args.rank} + noise {args.noise}; fresh process per row; torch 1 thread"
        )
        print(
            f"{'method':18s} {'T':>2s} {'add s':>7s} {'add s/task':>10s} {'merged s':>8s} "
            f"{'peak-base MB':>12s} {'state MB':>8s} {'(model MB)':>10s}"
        )
        for method in methods:
            for n in [int(x) for x in args.tasks.split(",")]:
                cmd = [
                    sys.executable,
                    __file__,
                    "--case",
                    method,
                    str(n),
                    "--layers",
                    str(args.layers),
                    "--dim",
                    str(args.dim),
                    "--rank",
                    str(args.rank),
                    "--noise",
                    str(args.noise),
                    "--seed",
                    str(args.seed),
                ]
                r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                print(
                    f"{method:18s} {n:2d} {r['add_s']:7.2f} {r['add_s'] / n:10.3f} "
                    f"{r['merged_s']:8.2f} {r['peak_extra_mb']:12.1f} {r['state_mb']:8.1f} "
                    f"{r['model_mb']:10.1f}",
                    flush=True,
                )

    print(
        f"\nquality after {args.quality_tasks} tasks ({args.quality_layers} layers, rank "
        f"{args.rank}): relative error of each task on its own subspace, "
        f"||P_t^T dW Q_t - S_t|| / ||S_t|| (0 = intact, 1 = lost)"
    )
    print(
        f"{'method':18s} | {'clean mean':>10s} {'worst':>6s} {'first':>6s} | "
        f"{'hard mean':>9s} {'worst':>6s} {'first':>6s}"
    )
    for method in methods:
        c = quality(method, args, noise=0.0, shared=0)
        h = quality(method, args, noise=args.noise, shared=2)
        print(
            f"{method:18s} | {c['mean']:10.3f} {c['worst']:6.3f} {c['first']:6.3f} | "
            f"{h['mean']:9.3f} {h['worst']:6.3f} {h['first']:6.3f}",
            flush=True,
        )
    print(
        "\nmethod settings: defaults of crucible.merge (task_arithmetic lam=0.3, ties density=0.2 "
        "lam=1, magmax lam=1, opcm alpha=0.5, gs3r energy=0.9 rank_budget=0.5 balance=1)"
    )


if __name__ == "__main__":
    main()
