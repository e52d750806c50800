"""MXFP4 Triton kernels on a CUDA GPU (an H200): correctness against the torch path, then speed.

    python benchmarks/mxfp4_gpu.py            # on a machine with a CUDA GPU; about 1 to 2 minutes
    python benchmarks/mxfp4_gpu.py --smoke    # tiny shapes on CPU under the Triton interpreter

(a) Checks, on the GPU (crucible.quant.triton_kernels against crucible.quant.mxfp4, the torch path):
    quantize, both scale modes, float32 / bfloat16 / float16 inputs, random rows over 60 decades and
    edge blocks (zeros, -0, NaN, +-inf, ties, subnormals, huge): packed and scale bytes equal to the
    torch path run on the same GPU; the same bytes against the torch path on the CPU are counted
    and reported (they can differ only in the sign bits of NaN-block codes: the torch path takes
    them from x * 0, whose NaN sign is the hardware's). dequantize: every byte value under every
    scale byte, to float32 / bfloat16 / float16, bit-equal (NaNs at the same places). mx_linear:
    against a float64 reference, with and without bias and a rank-16 adapter, float32 x
    (tf32x3, tf32) and bfloat16 x, and bit-exact on integer data (exact in any summation order).
(b) mx_linear (bfloat16 x, default blocks, and the best of a few block configs) against torch's
    bfloat16 matmul x @ W^T with W dequantized to bfloat16 beforehand (plus (x @ b^T) @ a^T, two
    more bf16 matmuls, with an adapter), and against the unfused pair Triton dequantize + bf16
    matmul; at M = N = K = 4096 and at the encoder's shapes (M = 4096 tokens; (N, K) = (384, 384),
    (1536, 384), (384, 1536)), r = 0 and 16. Median times of triton.testing.do_bench; TFLOP/s count
    2 M N K (+ 2 M r (N + K)).
(c) quantize (floor, ceil; float32 and bfloat16 x) and dequantize (to bfloat16, float32) at
    4096 x 4096: Triton against the torch path on the GPU, with the achieved GB/s.

Exit status 0 when every check passes, 1 when one fails (the table is still printed), 2 when there
is no CUDA device (or no triton). --smoke runs everything on CPU tensors under TRITON_INTERPRET=1 on
tiny shapes (times meaningless): it checks that the script and the kernels run.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv[1:]
if SMOKE:
    import warnings

    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the interpreter's numpy overflows (inf on purpose)

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from crucible.quant import mxfp4 as ref  # noqa: E402
from crucible.quant import triton_kernels as tk  # noqa: E402

NAN, INF = float("nan"), float("inf")
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        FAILURES.append(what)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN at the same places, every other element bit-equal (NaN payloads are the cast's own)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb])


def edge_blocks() -> torch.Tensor:
    blocks = []

    def blk(vals, fill=0.0):
        blocks.append((list(vals) + [fill] * 32)[:32])

    blk([])
    blk([], fill=-0.0)
    blk([NAN, -NAN, INF, -INF, 1.0, -1.0, -0.0, 0.0, 3.0], fill=0.5)
    blk([NAN])
    blk([-NAN, 2.0, -3.0], fill=-0.0)
    blk([INF, 1.0, -2.0, 0.0, -0.0, 3e38])
    blk([-INF, 5.0, -7.0], fill=-1e-3)
    blk([INF, -INF, 1.0])
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    exact = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for s in (2.0**3, 2.0**-10, 2.0**100):
        blk([6 * s] + [t * s for t in ties] + [-t * s for t in ties] + [-v * s for v in exact])
        blk(
            [6 * s]
            + [math.nextafter(t, 0) * s for t in ties]
            + [math.nextafter(t, 9) * s for t in ties]
            + [-math.nextafter(t, 9) * s for t in ties]
        )
    blk([7.9, -7.0, 6.5, 6.0, 5.9, -0.1])
    blk([4.0, 3.0, -2.0, 1e-3, -1e-3])
    blk([1e-39, -1e-39, 2.0**-127, 1.1e-38, -(2.0**-149), 2.0**-148, -5e-39])
    blk([2.0**-126, 1.5 * 2.0**-126, -(2.0**-125), 1e-39])
    blk([1e-39, 1.0, -1e-39])
    blk([3e38, -3.4028234663852886e38, 1e38, 2e37, -5e37, 1.0])
    blk([3.4028234663852886e38, 3.0e38, -2.9e38])
    blk([1.0, -1.0] * 16)
    blk([6.0 * 2.0**126, -3.0 * 2.0**126])
    blk([0.3, -0.7, 1.3, 2.6, -4.4, 5.5, -0.01, 0.126])
    return torch.tensor(blocks, dtype=torch.float32).reshape(-1, 64)


def bench(fn, dev) -> float:
    """Median milliseconds of fn()."""
    if dev.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


# ------------------------------------------------------------------------------------------------
# (a) correctness


def check_quantize(dev, rows: int, k: int) -> None:
    print("(a) quantize: Triton vs the torch path", flush=True)
    g = torch.Generator().manual_seed(0)
    cases = []
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        lo, hi = (-3, 3) if dt == torch.float16 else (-30, 30)
        x = torch.randn(rows, k, generator=g) * torch.logspace(lo, hi, rows)[:, None]
        cases.append((f"random {dt}".replace("torch.", ""), x.to(dt)))
    e = edge_blocks()
    cases += [("edge float32", e), ("edge bfloat16", e.to(torch.bfloat16))]
    for name, x in cases:
        xd = x.to(dev)
        for mode in ("floor", "ceil"):
            p, s = tk.quantize(xd, mode)
            q = ref.quantize(xd, mode)
            check(
                torch.equal(p, q.packed) and torch.equal(s, q.scales),
                f"{name} {mode}: bytes equal to the torch path on {dev.type}",
            )
            if dev.type == "cuda":
                qc = ref.quantize(x, mode)
                ds = int((s.cpu() != qc.scales).sum())
                dp = p.cpu() != qc.packed
                nan_rows = (qc.scales == ref.E8M0_NAN).repeat_interleave(16, dim=-1)
                outside = int((dp & ~nan_rows).sum())
                msg = (
                    f"{name} {mode}: vs the torch path on CPU: {ds} scale bytes and {int(dp.sum())} packed "
                    f"bytes differ, {outside} of them outside NaN blocks"
                )
                check(ds == 0 and outside == 0, msg)


def check_dequantize(dev) -> None:
    print("(a) dequantize: Triton vs the torch path", flush=True)
    packed = torch.arange(256, dtype=torch.uint8).repeat(16, 1).to(dev)
    scales = torch.arange(256, dtype=torch.uint8).reshape(16, 16).to(dev)
    q = ref.MXFP4Tensor(packed, scales, (16, 512))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        d = tk.dequantize(packed, scales, 512, dt)
        check(
            same_values(d, ref.dequantize(q, dt)), f"all bytes x all scales -> {str(dt)[6:]}: bit-equal, NaNs in place"
        )
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 1024, generator=g).to(dev)
    q = ref.quantize(w, "ceil")
    d = tk.dequantize(q.packed, q.scales, 1024, torch.bfloat16)
    check(same_values(d, ref.dequantize(q, torch.bfloat16)), "random ceil-mode weights -> bfloat16: bit-equal")


def reference_linear(x, q, bias, a, b) -> torch.Tensor:
    xd = x.double()
    y = xd @ ref.dequantize(q).double().T
    if bias is not None:
        y = y + bias.double()
    if a is not None:
        y = y + (xd @ b.to(x.dtype).double().T) @ a.double().T
    return y


def check_mx_linear(dev, shapes) -> None:
    print("(a) mx_linear: Triton vs a float64 reference", flush=True)
    g = torch.Generator().manual_seed(2)
    for m, n, k in shapes:
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dev)
        q = ref.quantize(w)
        x = torch.randn(m, k, generator=g).to(dev)
        bias = torch.randn(n, generator=g).to(dev)
        a = (torch.randn(n, 16, generator=g) * 0.3).to(dev)
        b = (torch.randn(16, k, generator=g) / math.sqrt(k)).to(dev)
        for with_extra in (False, True):
            args = (bias, a, b) if with_extra else (None, None, None)
            label = f"({m}, {n}, {k}){' + bias + rank 16' if with_extra else ''}"
            for dt, prec, tol in (
                (torch.float32, "tf32x3", 1e-4),
                (torch.float32, "tf32", 5e-3),
                (torch.bfloat16, "tf32x3", 1e-2),
            ):
                if dt == torch.float32 and prec == "tf32" and dev.type != "cuda":
                    continue  # the same as tf32x3 under the interpreter
                xx = x.to(dt)
                y = tk.mx_linear(xx, q.packed, q.scales, k, *args, precision=prec)
                want = reference_linear(xx, q, *args)
                err = float((y.double() - want).abs().max() / want.abs().max())
                check(
                    y.dtype == dt and y.shape == (m, n) and err <= tol,
                    f"{label} {str(dt)[6:]} {prec if dt == torch.float32 else ''}: max error / max |y| = {err:.2e} "
                    f"(<= {tol:g})",
                )
    wi = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 6.0])[torch.randint(0, 6, (96, 256), generator=g)]
    wi = wi * torch.where(torch.rand(96, 256, generator=g) < 0.5, -1.0, 1.0)
    wi[:, 0] = 6.0
    qi = ref.quantize(wi.to(dev))
    xi = torch.randint(-8, 9, (80, 256), generator=g).float().to(dev)
    exact = xi.double() @ wi.to(dev).double().T
    for dt in (torch.float32, torch.bfloat16):
        y = tk.mx_linear(xi.to(dt), qi.packed, qi.scales, 256)
        check(same_values(y, exact.to(dt)), f"integer data, {str(dt)[6:]}: bit-exact (bf16: round to nearest even)")


# ------------------------------------------------------------------------------------------------
# (b), (c) speed


def time_mx_linear(dev, shapes, ranks, configs) -> None:
    print("\n(b) mx_linear (bf16 x) vs torch bf16 matmul (ms, median)", flush=True)
    head = (
        f"{'M':>5} {'N':>5} {'K':>5} {'r':>3} | {'bf16':>8} {'mx':>8} {'mx/bf16':>7} | {'best mx':>8} "
        f"{'best/bf16':>9} {'best config':>20} | {'unfused':>8} | {'TF/s bf16':>9} {'TF/s mx':>8} {'TF/s best':>9}"
    )
    print(head)
    print("-" * len(head))
    g = torch.Generator().manual_seed(3)
    for m, n, k in shapes:
        w = torch.randn(n, k, generator=g).div_(math.sqrt(k)).to(dev)
        p, s = tk.quantize(w)
        wb = tk.dequantize(p, s, k, torch.bfloat16)
        x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
        for r in ranks:
            a = torch.randn(n, r, generator=g).mul_(0.1).to(dev) if r else None
            b = torch.randn(r, k, generator=g).div_(math.sqrt(k)).to(dev) if r else None
            ab, bb = (a.to(torch.bfloat16), b.to(torch.bfloat16)) if r else (None, None)

            if r:

                def torch_fn():
                    return F.linear(x, wb) + F.linear(F.linear(x, bb), ab)

                def unfused():
                    return F.linear(x, tk.dequantize(p, s, k, torch.bfloat16)) + F.linear(F.linear(x, bb), ab)
            else:

                def torch_fn():
                    return F.linear(x, wb)

                def unfused():
                    return F.linear(x, tk.dequantize(p, s, k, torch.bfloat16))

            t_bf16 = bench(torch_fn, dev)
            t_unf = bench(unfused, dev)
            t_mx = bench(lambda: tk.mx_linear(x, p, s, k, None, a, b), dev)
            best, best_cfg = t_mx, "default"
            for bm, bn, bk, nw, ns in configs:
                try:
                    t = bench(
                        lambda: tk.mx_linear(
                            x, p, s, k, None, a, b, block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns
                        ),
                        dev,
                    )
                except Exception as exc:  # e.g. out of shared memory for one config
                    print(f"  config {(bm, bn, bk, nw, ns)} failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                if t < best:
                    best, best_cfg = t, f"{bm}x{bn}x{bk} w{nw} s{ns}"
            flops = 2 * m * n * k + (2 * m * r * (n + k) if r else 0)
            tf = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
            print(
                f"{m:>5} {n:>5} {k:>5} {r:>3} | {t_bf16:8.4f} {t_mx:8.4f} {t_mx / t_bf16:7.2f} | {best:8.4f} "
                f"{best / t_bf16:9.2f} {best_cfg:>20} | {t_unf:8.4f} | {tf(t_bf16):9.1f} {tf(t_mx):8.1f} "
                f"{tf(best):9.1f}",
                flush=True,
            )
    d = tk.default_config(shapes[0][0], shapes[0][1], shapes[0][2], torch.bfloat16, device=dev)
    print(f"default config at {shapes[0]}: {d}")


def time_quant(dev, n: int) -> None:
    print(f"\n(c) quantize / dequantize at {n} x {n} (ms, median; GB/s of bytes read + written)", flush=True)
    head = f"{'op':<32} {'torch':>9} {'triton':>9} {'speedup':>8} {'GB/s triton':>12}"
    print(head)
    print("-" * len(head))
    g = torch.Generator().manual_seed(4)
    x32 = torch.randn(n, n, generator=g).to(dev)
    for dt in (torch.float32, torch.bfloat16):
        x = x32.to(dt)
        for mode in ("floor", "ceil"):
            t_ref = bench(lambda: ref.quantize(x, mode), dev)
            t_tk = bench(lambda: tk.quantize(x, mode), dev)
            nbytes = x.numel() * x.element_size() + x.numel() // 2 + x.numel() // 32
            print(
                f"{'quantize ' + mode + ' ' + str(dt)[6:]:<32} {t_ref:9.4f} {t_tk:9.4f} {t_ref / t_tk:8.1f} "
                f"{nbytes / (t_tk * 1e-3) / 1e9:12.1f}",
                flush=True,
            )
    q = ref.quantize(x32)
    for dt in (torch.bfloat16, torch.float32):
        t_ref = bench(lambda: ref.dequantize(q, dt), dev)
        t_tk = bench(lambda: tk.dequantize(q.packed, q.scales, n, dt), dev)
        nbytes = q.nbytes() + x32.numel() * torch.empty((), dtype=dt).element_size()
        print(
            f"{'dequantize -> ' + str(dt)[6:]:<32} {t_ref:9.4f} {t_tk:9.4f} {t_ref / t_tk:8.1f} "
            f"{nbytes / (t_tk * 1e-3) / 1e9:12.1f}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--skip-timing", action="store_true", help="run the checks (a) only")
    args = ap.parse_args()
    if not tk.available():
        print("error: triton is not importable; install triton to run the MXFP4 Triton kernels", file=sys.stderr)
        return 2
    if args.smoke:
        dev = torch.device("cpu")
        check_shapes = [(37, 45, 96)]
        time_shapes = [(64, 64, 64), (64, 32, 96)]
        configs = [(16, 16, 32, 4, 1), (32, 32, 64, 4, 1)]
        quant_n, rows, k = 128, 6, 96
    else:
        if not torch.cuda.is_available():
            print(
                "error: no CUDA device available (torch.cuda.is_available() is False). This benchmark needs a "
                "CUDA GPU; `python benchmarks/mxfp4_gpu.py --smoke` runs it on tiny CPU shapes under the "
                "Triton interpreter instead.",
                file=sys.stderr,
            )
            return 2
        dev = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
        check_shapes = [(300, 200, 384), (4096, 384, 1536), (1024, 1024, 4096)]
        time_shapes = [(4096, 4096, 4096), (4096, 384, 384), (4096, 1536, 384), (4096, 384, 1536)]
        configs = [
            (128, 128, 64, 8, 3),
            (64, 128, 64, 4, 3),
            (128, 256, 64, 8, 3),
            (128, 128, 128, 8, 3),
            (64, 64, 64, 4, 4),
        ]
        quant_n, rows, k = 4096, 512, 4096
    t0 = time.perf_counter()
    check_quantize(dev, rows, k)
    check_dequantize(dev)
    check_mx_linear(dev, check_shapes)
    if not args.skip_timing:
        time_mx_linear(dev, time_shapes, (0, 16), configs)
        time_quant(dev, quant_n)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if FAILURES:
        print(f"{len(FAILURES)} check(s) FAILED:\n  " + "\n  ".join(FAILURES), file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
