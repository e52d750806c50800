"""The GPU check's speed rows (benchmarks/gpu_check.py, part 4), timed as kernels (kernel_timing.py).

1. roofline: the device's measured copy bandwidth and bf16 / TF32 matmul rates, in this run.
2. decode (M = 1, 8, 16) at K = N = 4096 and 8192: the split-K MXFP4 decode kernel with its rank-16
   compensation adapter (what MXLinear runs for M <= 16) and the tiled kernel timed before it,
   against a bf16 cuBLAS matmul with the weight already dequantized; each with its achieved
   bandwidth as a share of the copy bandwidth. cuBLAS is checked against the roofline first (a
   baseline far below it means the timing, not the kernel, is measured). Goal >= 2x. At M = 1 and
   16 a sweep over split-K, tile width and K step says what tuning decode_config would gain.
3. prefill (M = 32 .. 4096, K = N = 4096): the route MXLinear takes above FUSED_MAX_M rows (Triton
   dequantization, then cuBLAS, adapter added) and the fused kernel, against bf16 cuBLAS; the
   smallest M from which the dequant-matmul route beats the fused kernel. Goal >= 0.9x.
4. CC-MMD kernel sums at each precision (tf32x3, the default: float32 accuracy from three TF32
   products; tf32; ieee FMA): their rate as a share of the measured TF32 matmul rate (goal >= 30 %)
   and the relative error against the float64 torch sums; then a sweep of tile shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from kernel_timing import copies_needed, fmt, kernel_time, roofline, share

DECODE_GOAL, PREFILL_GOAL, CCMMD_GOAL = 2.0, 0.9, 0.30
BASELINE_SHARE = 0.5  # a decode GEMV streams its weight: cuBLAS should reach half the copy rate


def _operands(n: int, k: int, copies: int, device, g) -> list[dict]:
    from crucible.quant import triton_kernels as tk

    sets = []
    for _ in range(copies):
        w = torch.randn(n, k, generator=g).to(device) * 0.05
        packed, scales = tk.quantize(w, "floor")
        sets.append(
            {
                "packed": packed,
                "scales": scales,
                "wb": tk.dequantize(packed, scales, k, torch.bfloat16),
                "a": (torch.randn(n, 16, generator=g) * 0.01).to(device),
                "b": (torch.randn(16, k, generator=g) * 0.01).to(device),
            }
        )
        del w
    return sets


def speed_rows(device: torch.device, row: Callable, smoke: bool) -> None:
    from crucible.quant import triton_decode as tdec
    from crucible.quant import triton_kernels as tk

    g = torch.Generator().manual_seed(0)
    peak = roofline(device, smoke)
    row(
        "roofline (measured here)",
        f"copy {peak['copy_gbs']:.0f} GB/s; bf16 matmul {peak['bf16_tflops']:.0f} TFLOP/s; "
        f"TF32 {peak['tf32_tflops']:.0f} TFLOP/s",
        "measured",
        None if smoke else True,
    )
    sizes = (256,) if smoke else (4096, 8192)
    for kn in sizes:
        n = k = kn
        wbytes = n * k * 2
        # rotate over enough copies that the MXFP4 weights (the smaller ones) exceed L2 4x, so neither
        # kernel finds its weight in L2 (the bf16 ones use the same sets)
        sets = _operands(n, k, copies_needed(n * k // 2, device), device, g)
        for m in (1, 16) if smoke else (1, 8, 16):
            xs = [torch.randn(m, k, generator=g).to(device).to(torch.bfloat16) for _ in sets]
            t_cublas = kernel_time([lambda s=s, x=x: x @ s["wb"].T for s, x in zip(sets, xs)], device)
            bw_cublas, sh_cublas = share(wbytes + 2 * m * (k + n), t_cublas, peak["copy_gbs"])
            if m == 1:  # the baseline is checked against the roofline before anything is compared to it
                row(
                    f"baseline: bf16 cuBLAS at M=1 K=N={k} against the copy roofline",
                    f"{fmt(t_cublas)}: {bw_cublas:.0f} GB/s, {sh_cublas:.0%} of the copy bandwidth",
                    f">= {BASELINE_SHARE:.0%} (else the timing measures overhead, not the kernel)",
                    None if smoke else sh_cublas >= BASELINE_SHARE,
                )
            qbytes = n * k // 2 + n * k // 32 + 16 * (n + k) * 4 + 2 * m * (k + n)

            def timed(sets=sets, xs=xs, **opts):
                return kernel_time(
                    [
                        lambda s=s, x=x: tk.mx_linear(x, s["packed"], s["scales"], k, None, s["a"], s["b"], **opts)
                        for s, x in zip(sets, xs)
                    ],
                    device,
                )

            t_dec = timed()  # what MXLinear runs for M <= 16: the split-K decode kernel, default config
            t_tiled = timed(block_m=16)  # the tiled kernel this check timed before
            bw_dec, sh_dec = share(qbytes, t_dec, peak["copy_gbs"])
            ratio = t_cublas["median_us"] / t_dec["median_us"]
            cfg = tdec.decode_config(n, k, device)
            row(
                f"decode: MXFP4 split-K kernel + rank-16 adapter vs bf16 cuBLAS, M={m} K=N={k}",
                f"{fmt(t_dec)} ({bw_dec:.0f} GB/s, {sh_dec:.0%} of copy; split {cfg['split_k']}, "
                f"{cfg['block_n']}x{cfg['block_k']}) vs {fmt(t_cublas)} ({bw_cublas:.0f} GB/s, "
                f"{sh_cublas:.0%} of copy) = {ratio:.2f}x; tiled kernel {fmt(t_tiled)} = "
                f"{t_cublas['median_us'] / t_tiled['median_us']:.2f}x",
                f"goal >= {DECODE_GOAL}x; cuBLAS near the copy roofline",
                None if smoke else ratio >= DECODE_GOAL,
            )
            if m in (1, 16):
                _decode_sweep(timed, t_dec, t_cublas, m, k, row, smoke)
        del sets
    _prefill(device, row, smoke, peak, g)
    _ccmmd(device, row, smoke, peak, g)


def _decode_sweep(timed, t_default, t_cublas, m: int, k: int, row, smoke: bool) -> None:
    """The decode kernel over split-K, tile width and K step: the best configuration against the
    default one (what tuning decode_config would gain), in the same run."""
    grid = (
        [(1, 64, 256), (4, 64, 256)]
        if smoke
        else [(split, bn, bk) for split in (1, 2, 4, 8, 16) for bn in (64, 128) for bk in (128, 256)]
    )
    t, split, bn, bk = min(
        ((timed(split_k=split, block_n=bn, block_k=bk), split, bn, bk) for split, bn, bk in grid),
        key=lambda run: run[0]["median_us"],
    )
    row(
        f"decode sweep: best of {len(grid)} configurations, M={m} K=N={k}",
        f"split {split}, {bn}x{bk}: {fmt(t)} = {t_cublas['median_us'] / t['median_us']:.2f}x cuBLAS "
        f"(default config {t_default['median_us'] / t['median_us']:.2f}x slower)",
        "measured",
        None if smoke else True,
    )


def _prefill(device, row, smoke: bool, peak: dict, g) -> None:
    from crucible.quant import linear as L
    from crucible.quant import triton_kernels as tk

    n = k = 256 if smoke else 4096
    layer = L.MXLinear.from_linear(torch.nn.Linear(k, n, bias=False), "floor").to(device)
    layer.set_adapter(torch.randn(n, 16, generator=g) * 0.01, torch.randn(16, k, generator=g) * 0.01)
    wb = layer.weight_dequantized(torch.bfloat16)
    crossover = None
    for m in (32, 64) if smoke else (32, 64, 128, 256, 1024, 4096):
        x = torch.randn(m, k, generator=g).to(device).to(torch.bfloat16)
        t_cublas = kernel_time([lambda: x @ wb.T], device)
        with torch.no_grad():
            t_route = kernel_time([lambda: layer(x)], device)  # M > FUSED_MAX_M: dequantize, then cuBLAS
            t_fused = kernel_time(
                [lambda: tk.mx_linear(x, layer.packed, layer.scales, k, None, layer.lora_a, layer.lora_b)], device
            )
        if crossover is None and t_route["median_us"] < t_fused["median_us"]:
            crossover = m
        ratio = t_cublas["median_us"] / t_route["median_us"]
        tflops, sh = share(2 * m * n * k, t_route, peak["bf16_tflops"], 1e12)
        row(
            f"prefill: MXLinear (dequantize + cuBLAS + adapter) vs bf16 cuBLAS, M={m} K=N={k}",
            f"{fmt(t_route)} ({tflops:.0f} TFLOP/s, {sh:.0%} of bf16 matmul) vs {fmt(t_cublas)} = {ratio:.2f}x; "
            f"fused kernel {fmt(t_fused)}",
            f"goal >= {PREFILL_GOAL}x",
            None if smoke else ratio >= PREFILL_GOAL,
        )
    row(
        "prefill: where dequantize + cuBLAS overtakes the fused kernel",
        f"from M = {crossover} (MXLinear switches above FUSED_MAX_M = {L.FUSED_MAX_M})"
        if crossover
        else "not within the Ms timed",
        "measured",
        None if smoke else True,
    )


def _ccmmd(device, row, smoke: bool, peak: dict, g) -> None:
    """The kernel sums at each precision of the Triton kernel (its share of TF32 and its error against
    float64), then tile shapes at the default precision."""
    from crucible.ccmmd import triton_kernels as ck
    from crucible.ccmmd.kernels import _gammas, augment_pair, kernel_matvec

    nx, d, kc = (256, 64, 4) if smoke else (16384, 384, 4)
    xs = torch.randn(nx, d, generator=g).to(device)
    w = torch.rand(nx, kc, generator=g, dtype=torch.float64).to(device)
    bws = [8.0, 16.0, 32.0]
    gam = _gammas(bws)
    xa, ya = augment_pair(xs)
    w32 = w.float()
    exact = kernel_matvec(xs.double(), xs.double(), w, bws, backend="torch").double()
    flops = nx * nx * (2 * d + 2 * kc * len(bws))  # the distances (a dot product) and the weighted sums

    def measure(**opts) -> tuple[dict, float, float, float]:
        # its small host-to-device copies cannot be captured in a graph; a call lasts milliseconds
        t = kernel_time([lambda: ck.triton_matvec(xa, ya, w32, gam, False, **opts)], device, graph=False)
        tflops, sh = share(flops, t, peak["tf32_tflops"], 1e12)
        got = ck.triton_matvec(xa, ya, w32, gam, False, **opts).double()
        return t, tflops, sh, float((got - exact).norm() / exact.norm())

    for prec in ck.PRECISIONS:
        t, tflops, sh, rel = measure(precision=prec)
        default = prec == "tf32x3"
        row(
            f"CC-MMD kernel sums ({prec}{', the default' if default else ''}), n={nx} d={d}, {len(bws)} bandwidths",
            f"{fmt(t)} = {tflops:.1f} TFLOP/s, {sh:.0%} of TF32 matmul; rel error vs float64 {rel:.1e}",
            f"goal >= {CCMMD_GOAL:.0%} of TF32, error <= 1e-5" if default else "measured (error and cost)",
            None if smoke else ((sh >= CCMMD_GOAL and rel <= 1e-5) if default else True),
        )
    tiles = (
        [(64, 64, 32, 4), (128, 64, 32, 8)]
        if smoke
        else [
            (64, 64, 32, 4),
            (128, 64, 32, 4),
            (128, 64, 32, 8),
            (64, 128, 32, 4),
            (128, 128, 32, 8),
            (128, 64, 64, 8),
        ]
    )

    def tile(bm: int, bn: int, bd: int, warps: int) -> tuple[dict, float, str]:
        t, _, sh, _ = measure(block_m=bm, block_n=bn, block_d=bd, num_warps=warps)
        return t, sh, f"{bm}x{bn}x{bd}, {warps} warps"

    best = min((tile(*c) for c in tiles), key=lambda run: run[0]["median_us"])
    row(
        f"CC-MMD tile sweep (tf32x3): best of {len(tiles)}",
        f"{best[2]}: {fmt(best[0])}, {best[1]:.0%} of TF32 matmul (default 64x64x32, 4 warps)",
        "measured",
        None if smoke else True,
    )
