"""MXFP4 on the CPU: crucible's torch path against torchao's MX implementation, same tensors, one run.

    .venv/bin/python benchmarks/mxfp4_speed.py [--repeats 15] [--threads 2]

For each shape (the encoder's matrices, 384 x 384, 1536 x 384, 384 x 1536, and 4096 x 4096):
- checks that crucible.quant.mxfp4 and torchao (`to_mx(..., FLOOR)` / `to_dtype`) give the same
  scale bytes, packed bytes and dequantized values (bit for bit);
- quantize and dequantize throughput (elements per second) of both, and the ratio crucible / torchao;
- the dequant-matmul of MXLinear (the CPU path: dequantize the weight, then one matmul; with and
  without a rank-16 adapter) against a float32 matmul with the same weight, at 256 tokens (4096
  for the 4096 x 4096 case), as a ratio of times.
The two sides take turns in each repeat and the median is reported, so a noisy machine slows both alike.
torchao must be installed (`pip install -r requirements/test.txt`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch


def interleaved(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    from crucible.quant import MXLinear, dequantize, quantize

    def ao_quant(x):
        return to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.FLOOR)

    def ao_dequant(s, d):
        return to_dtype(d, s, torch.float4_e2m1fn_x2, 32, torch.float32)

    print(
        f"# mxfp4_speed: torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats} "
        f"(median; the sides take turns)"
    )
    print(
        f"{'shape':>12} {'bit-exact':>9} {'quant Melem/s':>14} {'torchao':>8} {'ratio':>6} "
        f"{'dequant Melem/s':>16} {'torchao':>8} {'ratio':>6}"
    )
    g = torch.Generator().manual_seed(0)
    shapes = [(384, 384), (1536, 384), (384, 1536), (4096, 4096)]
    mm_rows = []
    for shape in shapes:
        w = torch.randn(*shape, generator=g) * 0.05
        s, d = ao_quant(w)
        q = quantize(w)
        exact = (
            torch.equal(q.scales, s.view(torch.uint8))
            and torch.equal(q.packed, d.view(torch.uint8))
            and torch.equal(dequantize(q), ao_dequant(s, d))
        )
        t = interleaved(
            {
                "ours_q": lambda: quantize(w),
                "ao_q": lambda: ao_quant(w),
                "ours_d": lambda: dequantize(q),
                "ao_d": lambda: ao_dequant(s, d),
            },
            args.repeats,
        )
        n = w.numel() / 1e6
        print(
            f"{'x'.join(map(str, shape)):>12} {str(exact):>9} {n / t['ours_q']:14.1f} {n / t['ao_q']:8.1f} "
            f"{t['ao_q'] / t['ours_q']:6.2f} {n / t['ours_d']:16.1f} {n / t['ao_d']:8.1f} "
            f"{t['ao_d'] / t['ours_d']:6.2f}"
        )
        if not exact:
            raise SystemExit(f"not bit-exact with torchao at shape {shape}")
        tokens = 4096 if shape == (4096, 4096) else 256
        x = torch.randn(tokens, shape[1], generator=g)
        lin = torch.nn.Linear(shape[1], shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        mx = MXLinear.from_linear(lin)
        r = 16
        mxr = MXLinear.from_linear(
            lin, adapter=(torch.randn(shape[0], r, generator=g) * 0.01, torch.randn(r, shape[1], generator=g) * 0.01)
        )
        with torch.no_grad():
            tm = interleaved({"float": lambda: lin(x), "mx": lambda: mx(x), "mx_r16": lambda: mxr(x)}, args.repeats)
        mm_rows.append((shape, tokens, tm))
    print()
    print("# dequant-matmul on the CPU (MXLinear's torch path) against a float32 matmul, same weight")
    print(f"{'shape':>12} {'tokens':>6} {'float ms':>9} {'mx ms':>8} {'mx/float':>8} {'mx+r16 ms':>10} {'ratio':>6}")
    for shape, tokens, tm in mm_rows:
        print(
            f"{'x'.join(map(str, shape)):>12} {tokens:6d} {1e3 * tm['float']:9.3f} {1e3 * tm['mx']:8.3f} "
            f"{tm['mx'] / tm['float']:8.2f} {1e3 * tm['mx_r16']:10.3f} {tm['mx_r16'] / tm['float']:6.2f}"
        )


if __name__ == "__main__":
    main()
