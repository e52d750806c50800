"""Kernel timings that measure the kernel: CUDA graphs, weights streamed from HBM, a measured roofline.

Used by benchmarks/gpu_check.py. On a GPU, `kernel_time`:
- captures `calls` (one per rotating copy of the operands, so that their bytes together exceed the
  L2 cache several times over and every call streams its weight from HBM, as in decode, where the
  weights of the next layer are not in L2) in one CUDA graph with `triton.testing.do_bench_cudagraph`,
  so launch and host overhead are not timed;
- takes `samples` replays of that graph; the time of one call is a replay's time / len(calls);
- reports the median and the spread (min, max over the replays) in microseconds.
`roofline` measures what the device does, in the same run, with the same method: the bandwidth of a
device-to-device copy (bytes read + written / time) and the rate of a large bf16 and a TF32 matmul.
`share` states a kernel's bytes / time (or FLOP / time) as a share of that measured peak, so a
baseline can be checked against the roofline before anything is compared to it.

Under `--smoke` (no GPU: the Triton interpreter on the CPU) the same calls are timed with
perf_counter, without graphs; those figures only show that the path runs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache size (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20)


def copies_needed(bytes_per_call: int, device: torch.device, times_l2: float = 4.0, cap: int = 64) -> int:
    """How many rotating copies of a call's operands exceed the L2 `times_l2` times (1 on the CPU)."""
    if device.type != "cuda" or bytes_per_call <= 0:
        return 1
    return max(2, min(cap, math.ceil(times_l2 * l2_bytes(device) / bytes_per_call)))


def kernel_time(
    calls: Sequence[Callable[[], object]], device: torch.device, samples: int = 10, graph: bool = True
) -> dict:
    """Per call: {"median_us", "min_us", "max_us", "samples"} (see the module docstring). graph=False
    for calls that synchronise with the host (input checks that read a value) and cannot be captured:
    triton's do_bench, which flushes L2 before each repetition; fine for calls of a millisecond or
    more, where launch overhead is small."""
    if device.type == "cuda":
        import triton.testing

        def one_round() -> None:
            for c in calls:
                c()

        if graph:
            times = triton.testing.do_bench_cudagraph(one_round, rep=max(20, samples * 2), return_mode="all")
        else:
            times = triton.testing.do_bench(one_round, warmup=25, rep=200, return_mode="all")
        per = [t * 1e3 / len(calls) for t in times]
    else:
        for c in calls:
            c()
        per = []
        for _ in range(max(2, min(samples, 3))):
            t = time.perf_counter()
            for c in calls:
                c()
            per.append((time.perf_counter() - t) * 1e6 / len(calls))
    return {"median_us": statistics.median(per), "min_us": min(per), "max_us": max(per), "samples": len(per)}


def fmt(t: dict) -> str:
    return f"{t['median_us']:.1f} us [{t['min_us']:.1f}, {t['max_us']:.1f}]"


def roofline(device: torch.device, smoke: bool = False) -> dict:
    """{"copy_gbs": device-to-device copy GB/s (read + write), "bf16_tflops", "tf32_tflops"}, each
    from kernel_time (a 1 GiB copy, 8192^3 matmuls; small ones under smoke)."""
    n = (4 << 20) if smoke else (1 << 28)  # float32 elements: 16 MiB or 1 GiB
    t = _copy_time(n, device)
    copy_gbs = 2 * n * 4 / (t["median_us"] * 1e-6) / 1e9
    mm = 256 if smoke else 8192
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(mm, mm, generator=g).to(device)
    out = {"copy_gbs": copy_gbs, "copy": t}
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        t32 = kernel_time([lambda: a @ a], device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    a16 = a.to(torch.bfloat16)
    t16 = kernel_time([lambda: a16 @ a16], device)
    out["tf32_tflops"] = 2 * mm**3 / (t32["median_us"] * 1e-6) / 1e12
    out["bf16_tflops"] = 2 * mm**3 / (t16["median_us"] * 1e-6) / 1e12
    return out


def _copy_time(n: int, device: torch.device) -> dict:
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return kernel_time([lambda: dst.copy_(src)], device)


def share(amount: float, t: dict, peak: float, scale: float = 1e9) -> tuple[float, float]:
    """(rate, rate / peak): `amount` (bytes or FLOP) per call over the median time, in units of
    `scale` per second (1e9: GB/s; 1e12: TFLOP/s)."""
    rate = amount / (t["median_us"] * 1e-6) / scale
    return rate, rate / peak if peak > 0 else float("nan")
