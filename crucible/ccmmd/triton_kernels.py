"""Triton kernel for the blockwise weighted Gaussian kernel sums of CC-MMD (docs/methods.md, curate).

Same contract and same results (to float32 rounding) as the torch path in ``kernels.py``: given the
augmented features x' = [2 x, -|x|^2, 1] and y' = [y, 1, -|y|^2] (so x'.y' = -|x - y|^2), each
program owns BLOCK_M rows of x and streams over y in BLOCK_N tiles, computing

    out[i, c] = sum_j sum_b exp2(log2(e) * gamma_b * x'_i.y'_j) * w[j, c]   (j != i if excluded)

with each tile's partial sums added into a float64 accumulator. The kernel matrix never leaves
registers. The dots run at ``precision``: "tf32x3" (the default) splits each float32 operand into
a TF32 high part and a TF32 remainder and adds three tensor-core products (hi.hi + hi.lo + lo.hi),
float32 accuracy at tensor-core rate; "tf32" rounds the operands to TF32 (10-bit mantissa: the
exponent x'.y' is a difference of terms as large as |x|^2, so its error grows with the norms; the
GPU check reports what it does to the estimate); "ieee" is FMA on the CUDA cores (float32, slow).

Imported lazily: the library works without triton. Runs on CUDA tensors, and on CPU tensors under
TRITON_INTERPRET=1 (set before triton is first imported), which is how the tests compare it with
the torch path. Weight columns are padded to 16 because tl.dot needs every dimension >= 16.
"""

from __future__ import annotations

import math

import torch

from crucible.device import launched

_LOG2E = 1.0 / math.log(2.0)
_KERNEL = None
PRECISIONS = ("tf32x3", "tf32", "ieee")


def available() -> bool:
    """True when triton imports (it may still need a GPU or TRITON_INTERPRET=1 to run)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _gauss_matvec(
        xa_ptr,
        ya_ptr,
        w_ptr,
        g_ptr,
        out_ptr,
        nx,
        ny,
        da,
        NB: tl.constexpr,
        EXCLUDE: tl.constexpr,
        PREC: tl.constexpr,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, K)
        acc = tl.zeros((BLOCK_M, K), dtype=tl.float64)
        for j0 in range(0, ny, BLOCK_N):
            rn = j0 + tl.arange(0, BLOCK_N)
            dot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for d0 in range(0, da, BLOCK_D):
                rd = d0 + tl.arange(0, BLOCK_D)
                xt = tl.load(
                    xa_ptr + rm[:, None] * da + rd[None, :], mask=(rm[:, None] < nx) & (rd[None, :] < da), other=0.0
                ).to(tl.float32)
                yt = tl.load(
                    ya_ptr + rn[None, :] * da + rd[:, None], mask=(rn[None, :] < ny) & (rd[:, None] < da), other=0.0
                ).to(tl.float32)
                dot += tl.dot(xt, yt, input_precision=PREC)
            # A distance is never negative; rounding can make the exponent slightly positive.
            dot = tl.minimum(dot, 0.0)
            kt = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for b in tl.static_range(NB):
                gb = tl.load(g_ptr + b)
                kt += tl.exp2(dot * gb)
            keep = (rm[:, None] < nx) & (rn[None, :] < ny)
            if EXCLUDE:
                keep = keep & (rm[:, None] != rn[None, :])
            kt = tl.where(keep, kt, 0.0)
            wt = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rn[:, None] < ny, other=0.0)
            part = tl.dot(kt, wt.to(tl.float32), input_precision=PREC)
            acc += part.to(tl.float64)
        tl.store(out_ptr + rm[:, None] * K + rk[None, :], acc, mask=rm[:, None] < nx)

    return _gauss_matvec


def triton_matvec(
    xa: torch.Tensor,
    ya: torch.Tensor,
    w: torch.Tensor,
    gammas,
    exclude_diagonal: bool,
    *,
    precision: str | None = None,
    block_m: int = 64,
    block_n: int = 64,
    block_d: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """out = K w as float64 (n_x, k), from augmented fp32 features (see module docstring).

    xa: (n_x, d+2), ya: (n_y, d+2), w: (n_y, k); any float dtype, upcast to float32 in the kernel.
    precision: "tf32x3", "tf32" or "ieee" (module docstring); None: "tf32x3", or "ieee" on a device
    where that does not build (a warning, once per device). Blocks: powers of two >= 16.
    Raises RuntimeError if triton is missing, ValueError for a bad precision or block.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r}; valid values are {PRECISIONS}")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_d", block_d)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name}: {v!r}; valid values are powers of two >= 16 (tl.dot's minimum)")
    global _KERNEL
    if not available():
        raise RuntimeError("backend 'triton' requested but triton is not importable; use backend='torch'")
    import triton

    if _KERNEL is None:
        _KERNEL = _build()
    nx, da = xa.shape
    ny, k = w.shape
    kp = max(16, triton.next_power_of_2(k))
    wp = torch.zeros(ny, kp, dtype=torch.float32, device=xa.device)
    wp[:, :k] = w
    g = torch.tensor([gm * _LOG2E for gm in gammas], dtype=torch.float32, device=xa.device)
    out = torch.empty(nx, kp, dtype=torch.float64, device=xa.device)
    grid = (triton.cdiv(nx, block_m),)
    args = (xa.contiguous(), ya.contiguous(), wp, g, out, nx, ny, da)
    opts = dict(
        NB=len(gammas),
        EXCLUDE=bool(exclude_diagonal),
        K=kp,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    if precision is not None:
        _KERNEL[grid](*args, PREC=precision, **opts)
    elif not launched(
        "CC-MMD: the tf32x3 kernel",
        xa.device,
        lambda: _KERNEL[grid](*args, PREC="tf32x3", **opts),
        "float32 FMA (ieee)",
    ):
        _KERNEL[grid](*args, PREC="ieee", **opts)
    return out[:, :k]
