"""Triton kernels for MXFP4: quantize, dequantize and the fused dequant-matmul ``mx_linear``.

Contract (the torch path ``crucible.quant.mxfp4`` is the definition; its docstring gives the format)
- ``quantize(x, mode)`` returns the same bytes as ``mxfp4.quantize(x, mode)``: packed uint8
  [..., K // 2] and scales uint8 [..., K // 32], bit for bit, special values included (zeros, NaN,
  +-inf, ties, -0.0, subnormal and huge inputs), for both scale modes. It repeats the torch path's
  arithmetic step by step: amax over the block in float32; the exponent from the integer bits of
  amax ("floor") or of the correctly rounded amax / 6 (``tl.div_rn``, "ceil"); clamp to
  [-127, 127] (ceil: finite blocks capped at 2^125); 2^-e built from its bits (0 for a NaN block);
  elements multiplied by it; E2M1 by comparison with the seven rounding boundaries (ties to the
  even code); sign from the sign bit of the scaled value. A NaN block's codes come from x itself
  (sign bit, magnitude 3 for NaN and +-inf, else 0), so they are the same on every device.
- ``dequantize(packed, scales, k, dtype)`` equals ``mxfp4.dequantize``: each code's value times
  2^(b - 127) in float32 (NaN for b = 255), then rounded to ``dtype``. bfloat16 is rounded from the
  float32 bits in the kernel (round to nearest even, NaN -> 0x7FC0), exact here anyway: every MXFP4
  value fits in bfloat16. float16 uses the device's RNE cast. float32 output is bit-equal NaNs
  included; in bfloat16 and float16 the NaN bit patterns are each conversion's own (torch's CPU
  bfloat16 cast gives 0xFFFF vectorised and 0x7FC0 scalar, CUDA 0x7FFF), all other values bit-equal.
- ``mx_linear(x, packed, scales, k, bias, a, b)`` = x @ dequantize(W)^T (+ bias) (+ (x @ b^T) @ a^T)
  for W (N, K) stored as packed (N, K // 2) and scales (N, K // 32), a (N, r), b (r, K); x float32
  or bfloat16 of shape (..., K); the result has x's dtype; all accumulation is float32.

The kernels' source and the tiling of ``mx_linear``: crucible.quant.triton_jit.

Imported lazily: this module imports without triton (``available()`` says whether it imports).
The kernels run on CUDA tensors, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1
set before triton is first imported). The interpreter stores bfloat16 as raw uint16 and gets
bfloat16 arithmetic and casts wrong, so the kernels never compute in bfloat16 there: bfloat16 inputs
are read as int16 bits and widened to float32 by a shift, outputs are rounded to bfloat16 from the
float32 bits, and under the interpreter the dots run in float32 (same products: bf16 x bf16 is exact
in float32). tests/library/test_mxfp4_triton.py runs all three kernels under the interpreter against the
torch path (bit equality for quantize and dequantize; mx_linear within 1e-4 of a float64 reference
for float32 x and 1e-2 for bfloat16 x, and bit-exact on integer data) and checks the wrappers'
argument validation. The GPU-only branch (bfloat16 x loaded as bfloat16 and multiplied on the
tensor cores) runs only on a GPU: benchmarks/mxfp4_gpu.py repeats all the checks there and times
the kernels.
"""

from __future__ import annotations

import torch

from crucible.device import launched
from crucible.quant import triton_decode
from crucible.quant.mxfp4 import BLOCK, MODES
from crucible.quant.triton_checks import (
    _check_block,
    _check_devices,
    _check_k,
    _check_packed,
    _check_tensor,
    _interpreting,
    _shape,
)

_KERNELS: dict | None = None
_MAX_RANK = 128
_X_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """True when triton imports (it may still need a GPU or TRITON_INTERPRET=1 to run)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _kernels() -> dict:
    global _KERNELS
    if not available():
        raise RuntimeError(
            "the MXFP4 Triton kernels need triton, which is not importable; use crucible.quant.mxfp4 (the torch path)"
        )
    if _KERNELS is None:
        from crucible.quant.triton_jit import build

        _KERNELS = build()
    return _KERNELS


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


# ---------------------------------------------------------------------------------------------
# wrappers


def quantize(x: torch.Tensor, mode: str = "floor", *, block_b: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float (float32, bfloat16 and float16 read directly, others cast to float32 first,
    as the torch path does), K % 32 == 0 -> (packed uint8 (..., K // 2), scales uint8 (..., K // 32)),
    bit-equal to ``crucible.quant.mxfp4.quantize(x, mode)``'s ``packed`` and ``scales``.
    block_b: MX blocks (rows of 32) per program. Raises ValueError for bad arguments."""
    where = "quantize"
    _check_tensor("x", x, where)
    if mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {MODES}, got {mode!r}")
    if not x.is_floating_point():
        raise ValueError(f"{where}: x must be a floating-point tensor, got {x.dtype} (shape {_shape(x)})")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK:
        raise ValueError(
            f"{where}: the last dimension of x must be a positive multiple of {BLOCK}, got shape {_shape(x)}"
        )
    if isinstance(block_b, bool) or not isinstance(block_b, int) or block_b < 1 or block_b & (block_b - 1):
        raise ValueError(f"{where}: block_b must be a power of two, got {block_b!r}")
    _check_devices(where, x=x)
    kern = _kernels()["quantize"]
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)
    x = x.contiguous()
    packed = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*lead, k // BLOCK, dtype=torch.uint8, device=x.device)
    nblocks = scales.numel()
    if nblocks:
        bf16 = x.dtype == torch.bfloat16
        xin = x.view(torch.int16) if bf16 else x
        grid = (-(-nblocks // block_b),)
        kern[grid](xin, packed, scales, nblocks, CEIL=mode == "ceil", BF16_BITS=bf16, BLOCK_B=block_b, num_warps=4)
    return packed, scales


_OUT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype = torch.float32, *, block_b: int = 64
) -> torch.Tensor:
    """packed uint8 (..., k // 2), scales uint8 (..., k // 32), k % 32 == 0 -> (..., k) in dtype,
    equal to ``crucible.quant.mxfp4.dequantize``: float32, bfloat16 and float16 written by the kernel
    (bit-equal; NaN payloads may differ where the torch path's own conversions do), other float
    dtypes cast from float32. Raises ValueError for bad arguments."""
    where = "dequantize"
    k = _check_k(k, where)
    lead = _check_packed(where, packed, scales, k)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if isinstance(block_b, bool) or not isinstance(block_b, int) or block_b < 1 or block_b & (block_b - 1):
        raise ValueError(f"{where}: block_b must be a power of two, got {block_b!r}")
    dev = _check_devices(where, packed=packed, scales=scales)
    kern = _kernels()["dequantize"]
    kdt = dtype if dtype in _OUT_CODE else torch.float32
    out = torch.empty(*lead, k, dtype=kdt, device=dev)
    nblocks = scales.numel()
    if nblocks:
        grid = (-(-nblocks // block_b),)
        dst = out.view(torch.int16) if kdt == torch.bfloat16 else out
        kern[grid](
            packed.contiguous(), scales.contiguous(), dst, nblocks, OUT=_OUT_CODE[kdt], BLOCK_B=block_b, num_warps=4
        )
    return out if kdt == dtype else out.to(dtype)


_PRECISIONS = ("tf32x3", "tf32", "ieee")


def default_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    precision: str = "tf32x3",
    device: torch.device | str | None = None,
) -> dict:
    """The block sizes, warps and stages ``mx_linear`` uses by default for an (m, k) x (n, k)^T product.

    bfloat16: 128 x 128 x 64 tiles, 8 warps, 3 stages; float32: BLOCK_K = 32 (32 x 32 tiles for the
    "ieee" FMA dot, which spills registers on bigger tiles). Tiles shrink (powers of two >= 16) to
    small m or n, and BLOCK_M drops to 64 when 128-row tiles would leave SMs of the GPU idle."""
    if dtype == torch.float32 and precision == "ieee":
        top_m, top_n, bk, stages = 32, 32, 32, 2
    else:
        top_m, top_n, bk, stages = 128, 128, (64 if dtype == torch.bfloat16 else 32), 3
    bm = _pow2_at_least(m, 16, top_m)
    bn = _pow2_at_least(n, 16, top_n)
    if dtype == torch.bfloat16 and m <= 16:
        # decode: the weight stream is the cost; narrow N tiles give more programs (N / 32) and
        # long K steps fewer loop trips (measured on an H200 by benchmarks/gpu_check.py at
        # K = N = 4096: 105 us with 128-wide N tiles and BLOCK_K 64, 30 us with these)
        bn, bk, stages = min(bn, 32), 128, 4
    dev = torch.device(device) if device is not None else None
    if bm == 128 and dev is not None and dev.type == "cuda":
        if -(-m // 128) * -(-n // bn) < triton_decode.sm_count(dev):
            bm = 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}


def mx_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    group_m: int = 8,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precision: str = "tf32x3",
    split_k: int | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(W)^T (+ bias) (+ (x @ b^T) @ a^T), fused (see the module docstring).

    x: (..., k) float32 or bfloat16; packed: uint8 (N, k // 2); scales: uint8 (N, k // 32), k % 32 == 0;
    bias: (N,); a: (N, r) and b: (r, k), both or neither, 1 <= r <= 128 (any float dtype; used in
    float32, b rounded to bfloat16 for bfloat16 x). Returns (..., N) in x's dtype, accumulated in
    float32. The low-rank term is computed in the same kernel (t = x @ b^T accumulated in the K loop,
    t @ a^T added in the epilogue). precision (float32 x on a GPU): "tf32x3" (float32-accurate on
    tensor cores), "tf32" (x rounded to TF32) or "ieee" (FMA). Block sizes: powers of two, >= 16
    (block_k >= 32); unset ones come from ``default_config``. Up to DECODE_MAX_M (16) rows with
    block_m unset, or with split_k given, the decode kernel runs (crucible.quant.triton_decode:
    split-K, tokens on the MMA's N side; block_n, block_k, num_warps and num_stages apply to it).
    Raises ValueError for bad arguments, before launching anything.
    """
    where = "mx_linear"
    k = _check_k(k, where)
    _check_tensor("x", x, where)
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"{where}: x must be float32 or bfloat16, got {x.dtype} (shape {_shape(x)})")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"{where}: x must have last dimension k = {k}, got shape {_shape(x)}")
    _check_tensor("packed", packed, where)
    if packed.dim() != 2:
        raise ValueError(f"{where}: packed must be 2-D (N, k // 2) = (N, {k // 2}), got shape {_shape(packed)}")
    n = packed.shape[0]
    _check_packed(where, packed, scales, k, lead=(n,))
    if bias is not None:
        _check_tensor("bias", bias, where)
        if not bias.is_floating_point() or tuple(bias.shape) != (n,):
            raise ValueError(
                f"{where}: bias must be a float tensor of shape [{n}], got {bias.dtype} of shape {_shape(bias)}"
            )
    if (a is None) != (b is None):
        raise ValueError(
            f"{where}: pass both a (N, r) and b (r, k) or neither, got "
            f"a={'None' if a is None else _shape(a)} and b={'None' if b is None else _shape(b)}"
        )
    r = 0
    if a is not None:
        _check_tensor("a", a, where)
        _check_tensor("b", b, where)
        if not a.is_floating_point() or not b.is_floating_point():
            raise ValueError(f"{where}: a and b must be floating point, got {a.dtype} and {b.dtype}")
        if a.dim() != 2 or a.shape[0] != n:
            raise ValueError(f"{where}: a must have shape (N, r) with N = {n}, got {_shape(a)}")
        r = a.shape[1]
        if b.dim() != 2 or tuple(b.shape) != (r, k):
            raise ValueError(f"{where}: b must have shape (r, k) = {[r, k]} (a is {_shape(a)}), got {_shape(b)}")
        if not 1 <= r <= _MAX_RANK:
            raise ValueError(f"{where}: the adapter rank r = a.shape[1] must be in [1, {_MAX_RANK}], got a {_shape(a)}")
    if precision not in _PRECISIONS:
        raise ValueError(f"{where}: precision must be one of {_PRECISIONS}, got {precision!r}")
    lead = tuple(x.shape[:-1])
    m = 1
    for d in lead:
        m *= d
    if block_m is not None:
        _check_block("block_m", block_m, where)
    if block_n is not None:
        _check_block("block_n", block_n, where)
    if block_k is not None:
        _check_block("block_k", block_k, where, lo=32)
    if isinstance(group_m, bool) or not isinstance(group_m, int) or group_m < 1:
        raise ValueError(f"{where}: group_m must be a positive int, got {group_m!r}")
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages), ("split_k", split_k)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}: {name} must be a positive int, got {v!r}")
    decode = split_k is not None or (m <= triton_decode.DECODE_MAX_M and block_m is None)
    if decode and m > triton_decode.DECODE_MAX_M:
        raise ValueError(f"{where}: split_k is for at most {triton_decode.DECODE_MAX_M} rows of x, got {m}")
    dev = _check_devices(where, x=x, packed=packed, scales=scales, bias=bias, a=a, b=b)
    kern = _kernels()["mx_linear"]

    y = torch.empty(*lead, n, dtype=x.dtype, device=dev)
    if m == 0 or n == 0:
        return y
    # what both kernels take: x, W's bytes and scales, bias, a, b (float32; a dummy where absent) and
    # their shared compile-time flags
    bf16 = x.dtype == torch.bfloat16
    dot_bf16 = bf16 and not _interpreting()
    dummy = torch.empty(1, dtype=torch.float32, device=dev)

    def f32(t):
        return dummy if t is None else t.to(torch.float32).contiguous()

    x2 = x.reshape(m, k).contiguous()
    ptrs = (
        x2.view(torch.int16) if (bf16 and not dot_bf16) else x2,
        packed.contiguous(),
        scales.contiguous(),
        f32(bias),
        f32(a),
        f32(None if b is None else b.to(torch.bfloat16) if bf16 else b),  # b rounded for bf16 tensor cores
    )
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_LR=r > 0,
        R=max(16, 1 << (r - 1).bit_length()) if r else 16,
        X_BITS=bf16 and not dot_bf16,
        DOT_BF16=dot_bf16,
        OUT_BF16=bf16,
        PREC=precision,
        EPI_PREC="tf32" if bf16 else precision,
    )
    yout = y.view(m, n).view(torch.int16) if bf16 else y.view(m, n)
    if decode:
        opts = dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps, num_stages=num_stages)

        def run():
            triton_decode.launch(_kernels(), ptrs, flags, yout, m, n, k, max(r, 1), **opts)

        # an explicit split_k gets the decode kernel or its error; the automatic route falls back
        if split_k is not None:
            run()
            return y
        if launched("mx_linear: the MXFP4 decode kernel", dev, run, "the tiled kernel"):
            return y
    cfg = default_config(m, n, k, x.dtype, precision, dev)
    bm = block_m or cfg["block_m"]
    bn = block_n or cfg["block_n"]
    kern[(-(-m // bm) * -(-n // bn),)](
        *ptrs,
        yout,
        m,
        n,
        k,
        max(r, 1),
        **flags,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=block_k or cfg["block_k"],
        GROUP_M=group_m,
        num_warps=num_warps or (8 if bm * bn >= 128 * 128 else 4),
        num_stages=num_stages or cfg["num_stages"],
    )
    return y
