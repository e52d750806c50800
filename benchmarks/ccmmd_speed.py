"""Throughput of the exact CC-MMD kernel sums against the matmul rate and the full-matrix peer.

    python benchmarks/ccmmd_speed.py --device cpu --sizes 5000,20000
    python benchmarks/ccmmd_speed.py --device cuda --sizes 5000,20000,100000

For each pool size n (dimension --dim, 4 weight columns, one bandwidth) it runs, each case in a
fresh subprocess so that peak memory is that case's own (ru_maxrss on CPU, torch.cuda max memory on
GPU):
  cross   sum_j k(x_i, y_j) w_j, n x n, blockwise (crucible.ccmmd.kernel_matvec)
  within  sum_{j != l} k(y_j, y_l) w_l, blockwise, symmetric (half the pairs)
  mm      torch.mm on the same block shapes and the same number of blocks (the GEMM alone)
  full    the straightforward peer: torch.cdist + exp on the full n x n matrix, then @ w;
          reported as infeasible, not run, when the matrix would not fit in --mem-gb (24 GB)
and prints the kernel sums' rate as a fraction of the measured matmul rate and the speed ratio
against the full-matrix peer. Rates count 2 d flops per kernel entry actually evaluated.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_case(case: str, n: int, d: int, device: str, block: int | None) -> dict:
    from crucible.ccmmd import kernel_matvec
    from crucible.ccmmd.kernels import DEFAULT_BLOCK

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).div_(d**0.5).to(device)
    y = torch.randn(n, d, generator=g).div_(d**0.5).to(device)
    w = torch.randn(n, 4, generator=g).to(device)
    h = 1.0
    b = block or DEFAULT_BLOCK
    # Warm up: thread pools, MKL dispatch, Triton compilation.
    kernel_matvec(x[: 2 * b], y[: 2 * b], w[: 2 * b], h, block_size=block)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    if case == "cross":
        out = kernel_matvec(x, y, w, h, block_size=block)
        entries = n * n
    elif case == "within":
        out = kernel_matvec(y, None, w, h, exclude_diagonal=True, block_size=block)
        nb = -(-n // b)
        entries = (nb * (nb + 1) // 2) * b * b if device == "cpu" else n * n
    elif case == "mm":
        a = torch.randn(b, d + 2, device=device)
        c = torch.randn(b, d + 2, device=device)
        o = torch.empty(b, b, device=device)
        reps = min((-(-n // b)) ** 2, 400)
        for _ in range(3):
            torch.mm(a, c.T, out=o)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, c.T, out=o)
        out = o
        entries = reps * b * b
    elif case == "full":
        out = torch.exp(-(torch.cdist(x, y) ** 2) / (2 * h * h)) @ w
        entries = n * n
    sync(device)
    dt = time.perf_counter() - t0
    assert torch.isfinite(out).all()
    peak = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"case": case, "n": n, "seconds": dt, "gflops": 2 * d * entries / dt / 1e9, "peak_gb": peak / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sizes", default="5000,20000,100000")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--mem-gb", type=float, default=24.0, help="memory budget for the full-matrix peer")
    ap.add_argument("--skip-full-above", type=int, default=None, help="also skip the peer above this n")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        case, n = args.case.split(":")
        print(json.dumps(run_case(case, int(n), args.dim, args.device, args.block)))
        return
    print(f"device={args.device} dim={args.dim} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(f"{'n':>7} {'case':>7} {'seconds':>9} {'GFLOP/s':>9} {'peak GB':>8} {'vs mm':>6} {'vs full':>8}")
    for n in [int(s) for s in args.sizes.split(",")]:
        res = {}
        for case in ("mm", "cross", "within", "full"):
            # cdist output + exp temporary + the norms: about two n x n float32 matrices.
            need_gb = 2 * n * n * 4 / 1e9
            if case == "full" and (need_gb > args.mem_gb or (args.skip_full_above and n > args.skip_full_above)):
                why = f"needs ~{need_gb:.0f} GB > {args.mem_gb:.0f} GB" if need_gb > args.mem_gb else "skipped by flag"
                print(f"{n:>7} {'full':>7} {'infeasible: ' + why:>40}")
                continue
            cmd = [
                sys.executable,
                __file__,
                "--case",
                f"{case}:{n}",
                "--device",
                args.device,
                "--dim",
                str(args.dim),
            ] + (["--block", str(args.block)] if args.block else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{n:>7} {case:>7} failed: {p.stderr.strip().splitlines()[-1:]}")
                continue
            r = res[case] = json.loads(p.stdout.strip().splitlines()[-1])
            vs_mm = f"{r['gflops'] / res['mm']['gflops']:.2f}" if case in ("cross", "within") and "mm" in res else ""
            vs_full = ""
            if case == "full":
                for c in ("cross", "within"):
                    if c in res:
                        vs_full += f"{c}:{r['seconds'] / res[c]['seconds']:.1f}x "
            print(
                f"{n:>7} {case:>7} {r['seconds']:>9.3f} {r['gflops']:>9.1f} {r['peak_gb']:>8.2f} "
                f"{vs_mm:>6} {vs_full:>8}",
                flush=True,
            )
    print(
        "vs mm: kernel-sum GFLOP/s / torch.mm GFLOP/s on the same block shapes (2 d flops per "
        "entry evaluated).\nvs full: full-matrix seconds / blockwise seconds (>1 = blockwise faster)."
    )


if __name__ == "__main__":
    main()
