"""The Triton source of the MXFP4 kernels that crucible.quant.triton_kernels launches: quantize,
dequantize and the fused dequant-matmul, defined by `build()` on first use (triton is imported
there, not at import time). Their contract, the wrappers with their argument checks, and the notes
on the Triton interpreter are in crucible.quant.triton_kernels.

Tiling of ``mx_linear`` (one kernel launch)
- Programs own BLOCK_M x BLOCK_N output tiles, ordered in groups of GROUP_M row blocks (L2 reuse),
  and loop over K in BLOCK_K steps (BLOCK_K >= 32: whole MX blocks). Each step loads the x tile
  (BLOCK_M, BLOCK_K), the packed bytes (BLOCK_N, BLOCK_K // 2) and the scale bytes
  (BLOCK_N, BLOCK_K // 32) of W as plain 2-D tiles (all three are software-pipelined into shared
  memory by cp.async), and dequantizes W in registers: each nibble becomes its E2M1 value with a few
  selects, times its block's scale (broadcast over the block's 16 bytes), and the low and high
  nibbles are interleaved back into K order (``tl.interleave``). The float W never reaches memory.
- bfloat16 x on a GPU: the dequantized tile is cast to bfloat16 (lossless: an E2M1 value times a
  power of two has at most two significant bits and bfloat16 has float32's exponent range) and fed
  to the tensor cores (wgmma on Hopper) with a float32 accumulator. float32 x: ``precision``
  "tf32x3" (default: three TF32 products, float32 accuracy on tensor cores; W is exact in TF32),
  "tf32" (x rounded to TF32) or "ieee" (FMA; slow, small tiles only).
- Low-rank adapter, computed in the same kernel: in the same K loop the program also accumulates
  t = x_tile @ b_tile^T (BLOCK_M, R) (R = r padded to a power of two >= 16 by masked loads, no
  copies), and the epilogue adds t @ a_tile^T (TF32 for bfloat16 x, below bfloat16's resolution;
  ``precision`` for float32 x) and the bias, then stores. Every column block recomputes its rows' t:
  R / BLOCK_N extra MACs (1/8 for r <= 16 and BLOCK_N = 128), in exchange for no second launch and
  no second pass over x. For bfloat16 x, b is rounded to bfloat16 (x @ b^T runs on bf16 tensor cores).
- Defaults (``default_config``): bfloat16 128 x 128 x 64 tiles, 8 warps, 3 stages (157 registers,
  no spills, 72 KiB shared memory on sm_90 by ptxas); BLOCK_M 64 when 128-row tiles would leave SMs
  idle; tiles shrink (powers of two >= 16) for small M or N. float32: BLOCK_K = 32.
  ``tl.dot`` needs every dimension >= 16. M, N and K need not be multiples of the blocks (masked
  loads and stores); K must be a multiple of 32, the MX block.

Decode (``mx_decode``, M <= 16 rows; launched by crucible.quant.triton_decode)
- The product is computed transposed, y^T = W x^T: W's rows fill the MMA's M side (BLOCK_N = 64 or
  128, what wgmma wants) and the few tokens its N side (BLOCK_T = 16), so no MMA lane is spent on
  padding rows of x.
- Split-K: a (N / BLOCK_N, SPLIT_K) grid, each program streaming K / SPLIT_K columns of its rows, so
  that every SM has weights in flight even when N / BLOCK_N is below the SM count; each split writes
  float32 partial sums and ``splitk_reduce`` adds them in split order (deterministic; no atomics),
  adds the bias and rounds to x's dtype. SPLIT_K = 1 does that epilogue in the kernel itself.
- Nibbles in their stored order: a byte holds W[n, 2j] (low) and W[n, 2j + 1] (high); instead of
  interleaving the dequantized nibbles back into K order (register shuffles on the weight, the large
  operand) the kernel reads x's even and odd columns and runs two dots of half the K step. The
  adapter's t = b x^T is accumulated from the same even / odd tiles of x; the epilogue adds a t.
"""

from __future__ import annotations


def build() -> dict:
    """Define (jit) the kernels; {"quantize", "dequantize", "mx_linear", "mx_decode", "splitk_reduce"}
    -> the triton.jit function."""
    import triton
    import triton.language as tl

    # Helpers are module globals: jitted functions resolve callees through their module's globals
    # (the interpreter does not see closures).
    global _mx_load_f32, _mx_e2m1_code, _mx_special_code, _mx_e2m1_value, _mx_scale_value, _mx_bf16_bits
    global _mx_w_planes, _mx_store

    @triton.jit
    def _mx_load_f32(ptr, offs, mask, BF16_BITS: tl.constexpr):
        # float32 values of x; BF16_BITS: ptr is x viewed as int16, widened exactly by a shift
        if BF16_BITS:
            v = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
            return (v << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _mx_e2m1_code(s):
        # 4-bit code of float32 s (already divided by the scale): nearest E2M1 magnitude, ties to the
        # even code, saturating at 6; sign from the sign bit; NaN -> 3 | sign
        a = tl.abs(s)
        mag = (
            (a > 0.25).to(tl.int32)
            + (a >= 0.75).to(tl.int32)
            + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32)
            + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32)
        )
        mag = tl.where(s != s, 3, mag)
        sign = (s.to(tl.int32, bitcast=True) >> 31) & 1
        return mag | (sign << 3)

    @triton.jit
    def _mx_special_code(x):
        # code of an element of a NaN block: sign bit of x, magnitude 3 for NaN and +-inf, else 0
        sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
        finite = tl.abs(x) <= 3.4028234663852886e38
        return tl.where(finite, 0, 3) | (sign << 3)

    @triton.jit
    def _mx_e2m1_value(c):
        # float32 value of the 4-bit code c (int32): 0, .5, 1, 1.5, 2, 3, 4, 6 with sign bit 8
        m = c & 7
        mf = m.to(tl.float32)
        v = tl.where(m < 4, mf * 0.5, tl.where(m < 7, mf - 2.0, 6.0))
        return tl.where(c >= 8, -v, v)

    @triton.jit
    def _mx_scale_value(b):
        # float32 2^(b - 127) of the E8M0 byte b (int32), from its bits; 2^-127 is subnormal; NaN for 255
        bits = tl.where(b == 0, 0x400000, tl.where(b == 255, 0x7FC00000, b << 23))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _mx_bf16_bits(v):
        # bfloat16 bits (int16) of float32 v, round to nearest even, NaN -> 0x7FC0 (torch's CPU rule)
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return (r & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _mx_w_planes(p_ptr, s_ptr, rn64, nmask, k0, k_end, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # rows rn of W, columns k0 .. k0 + BLOCK_K (those below k_end), dequantized in registers as
        # two (BLOCK_N, BLOCK_K // 2) planes: lo = W[:, k0 + 2j], hi = W[:, k0 + 2j + 1]. Packed bytes
        # (BLOCK_N, BLOCK_K // 2), scales (BLOCK_N, BLOCK_K // 32) broadcast over their 16 bytes.
        jk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        pb = tl.load(
            p_ptr + rn64[:, None] * (K // 2) + jk[None, :], mask=nmask[:, None] & (jk < k_end // 2)[None, :], other=0
        ).to(tl.int32)
        sk = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sb = tl.load(
            s_ptr + rn64[:, None] * (K // 32) + sk[None, :],
            mask=nmask[:, None] & (sk < k_end // 32)[None, :],
            other=127,
        ).to(tl.int32)
        sv = _mx_scale_value(sb)
        sv = tl.reshape(tl.broadcast_to(sv[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        return _mx_e2m1_value(pb & 0xF) * sv, _mx_e2m1_value(pb >> 4) * sv

    @triton.jit
    def _mx_store(ptr, offs, acc, mask, OUT_BF16: tl.constexpr):
        # float32 acc, or its bfloat16 bits (ptr an int16 view) rounded to nearest even
        if OUT_BF16:
            tl.store(ptr + offs, _mx_bf16_bits(acc), mask=mask)
        else:
            tl.store(ptr + offs, acc, mask=mask)

    @triton.jit
    def _quantize_kernel(
        x_ptr, packed_ptr, scales_ptr, nblocks, CEIL: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_B: tl.constexpr
    ):
        # x viewed as (nblocks, 32): one row per MX block, split into its even and odd elements
        pid = tl.program_id(0)
        rb = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        rj = tl.arange(0, 16)
        bmask = rb < nblocks
        m2 = bmask[:, None]
        xv = _mx_load_f32(x_ptr, rb[:, None] * 32 + tl.arange(0, 32)[None, :], m2, BF16_BITS)
        nan = xv != xv
        has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
        # amax of the finite and infinite elements (a NaN block's amax is never used)
        amax = tl.max(tl.where(nan, 0.0, tl.abs(xv)), axis=1)
        if CEIL:
            bits = tl.div_rn(amax, 6.0).to(tl.int32, bitcast=True)
            e = (((bits + 0x7FFFFF) >> 23) & 0xFF) - 127
            # finite blocks are capped at 2^125 (mxfp4._CEIL_EMAX): at 2^126 the grid overflows float32
            e = tl.where(amax > 3.4028234663852886e38, e, tl.minimum(e, 125))
        else:
            bits = amax.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 129
        e = tl.minimum(tl.maximum(e, -127), 127)
        n = -e
        inv = tl.where(n > -127, (n + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
        inv = tl.where(has_nan, 0.0, inv)
        byte = tl.where(has_nan, 255, e + 127)
        tl.store(scales_ptr + rb, byte.to(tl.uint8), mask=bmask)
        xe, xo = tl.split(tl.reshape(xv, (BLOCK_B, 16, 2)))
        ce = _mx_e2m1_code(xe * inv[:, None])
        co = _mx_e2m1_code(xo * inv[:, None])
        # a NaN block's codes come from x itself: sign bit, and 3 for NaN and +-inf (mxfp4.quantize)
        ce = tl.where(has_nan[:, None], _mx_special_code(xe), ce)
        co = tl.where(has_nan[:, None], _mx_special_code(xo), co)
        tl.store(packed_ptr + rb[:, None] * 16 + rj[None, :], (ce | (co << 4)).to(tl.uint8), mask=m2)

    @triton.jit
    def _dequantize_kernel(packed_ptr, scales_ptr, out_ptr, nblocks, OUT: tl.constexpr, BLOCK_B: tl.constexpr):
        # OUT: 0 float32, 1 bfloat16 (out viewed as int16), 2 float16
        pid = tl.program_id(0)
        rb = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        rj = tl.arange(0, 16)
        bmask = rb < nblocks
        m2 = bmask[:, None]
        p = tl.load(packed_ptr + rb[:, None] * 16 + rj[None, :], mask=m2, other=0).to(tl.int32)
        s = _mx_scale_value(tl.load(scales_ptr + rb, mask=bmask, other=127).to(tl.int32))
        ve = _mx_e2m1_value(p & 0xF) * s[:, None]
        vo = _mx_e2m1_value(p >> 4) * s[:, None]
        offs = rb[:, None] * 32 + tl.arange(0, 32)[None, :]
        if OUT == 1:
            tl.store(out_ptr + offs, tl.interleave(_mx_bf16_bits(ve), _mx_bf16_bits(vo)), mask=m2)
        elif OUT == 2:
            tl.store(out_ptr + offs, tl.interleave(ve.to(tl.float16), vo.to(tl.float16)), mask=m2)
        else:
            tl.store(out_ptr + offs, tl.interleave(ve, vo), mask=m2)

    @triton.jit
    def _mx_linear_kernel(
        x_ptr,
        p_ptr,
        s_ptr,
        bias_ptr,
        a_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        r,
        HAS_BIAS: tl.constexpr,
        HAS_LR: tl.constexpr,
        R: tl.constexpr,
        X_BITS: tl.constexpr,
        DOT_BF16: tl.constexpr,
        OUT_BF16: tl.constexpr,
        PREC: tl.constexpr,
        EPI_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        rr = tl.arange(0, R)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        t = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            xmask = mmask[:, None] & kmask[None, :]
            xoffs = rm64[:, None] * K + rk[None, :]
            if DOT_BF16:
                xt = tl.load(x_ptr + xoffs, mask=xmask, other=0.0)
            else:
                xt = _mx_load_f32(x_ptr, xoffs, xmask, X_BITS)
            # W tile (BLOCK_N, BLOCK_K), dequantized in registers, low/high nibbles interleaved into K order
            lo, hi = _mx_w_planes(p_ptr, s_ptr, rn64, nmask, k0, K, K, BLOCK_N, BLOCK_K)
            if DOT_BF16:
                w = tl.interleave(lo.to(tl.bfloat16), hi.to(tl.bfloat16))
                acc = tl.dot(xt, tl.trans(w), acc)
            else:
                w = tl.interleave(lo, hi)
                acc = tl.dot(xt, tl.trans(w), acc, input_precision=PREC)
            if HAS_LR:
                bt = tl.load(b_ptr + rr[None, :] * K + rk[:, None], mask=(rr[None, :] < r) & kmask[:, None], other=0.0)
                if DOT_BF16:
                    t = tl.dot(xt, bt.to(tl.bfloat16), t)
                else:
                    t = tl.dot(xt, bt, t, input_precision=PREC)
        if HAS_LR:
            at = tl.load(a_ptr + rn64[None, :] * r + rr[:, None], mask=(rr[:, None] < r) & nmask[None, :], other=0.0)
            acc = tl.dot(t, at, acc, input_precision=EPI_PREC)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0)[None, :]
        _mx_store(y_ptr, rm64[:, None] * N + rn64[None, :], acc, mmask[:, None] & nmask[None, :], OUT_BF16)

    @triton.jit
    def _mx_decode_kernel(
        x_ptr,
        p_ptr,
        s_ptr,
        bias_ptr,
        a_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        r,
        K_SPLIT,
        HAS_BIAS: tl.constexpr,
        HAS_LR: tl.constexpr,
        R: tl.constexpr,
        X_BITS: tl.constexpr,
        DOT_BF16: tl.constexpr,
        OUT_BF16: tl.constexpr,
        PARTIAL: tl.constexpr,
        PREC: tl.constexpr,
        EPI_PREC: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # y^T tile (BLOCK_N, BLOCK_T) of W's rows pid_n over K range pid_k: W rows on the MMA's M side,
        # the few tokens on its N side; nibbles consumed in their stored order (x split into its even
        # and odd columns, W never interleaved); PARTIAL: float32 partial sums to out[pid_k] (the
        # split-K reduction adds them in a fixed order), else bias, rounding and the store here.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rn64 = rn.to(tl.int64)
        rt = tl.arange(0, BLOCK_T)
        tmask = rt < M
        rt64 = rt.to(tl.int64)
        rr = tl.arange(0, R)
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        t = tl.zeros((R, BLOCK_T), dtype=tl.float32)
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            lo, hi = _mx_w_planes(p_ptr, s_ptr, rn64, nmask, k0, k_hi, K, BLOCK_N, BLOCK_K)
            jk = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # the byte index j: lo is W[:, 2j], hi W[:, 2j + 1]
            jmask = jk < k_hi // 2
            # x^T's even and odd rows (BLOCK_K // 2, BLOCK_T)
            xoffs = rt64[None, :] * K + (2 * jk)[:, None]
            xmask = tmask[None, :] & jmask[:, None]
            if DOT_BF16:
                xe = tl.load(x_ptr + xoffs, mask=xmask, other=0.0)
                xo = tl.load(x_ptr + xoffs + 1, mask=xmask, other=0.0)
                acc = tl.dot(lo.to(tl.bfloat16), xe, acc)
                acc = tl.dot(hi.to(tl.bfloat16), xo, acc)
            else:
                xe = _mx_load_f32(x_ptr, xoffs, xmask, X_BITS)
                xo = _mx_load_f32(x_ptr, xoffs + 1, xmask, X_BITS)
                acc = tl.dot(lo, xe, acc, input_precision=PREC)
                acc = tl.dot(hi, xo, acc, input_precision=PREC)
            if HAS_LR:
                boffs = rr[:, None] * K + (2 * jk)[None, :]
                bmask = (rr[:, None] < r) & jmask[None, :]
                be = tl.load(b_ptr + boffs, mask=bmask, other=0.0)
                bo = tl.load(b_ptr + boffs + 1, mask=bmask, other=0.0)
                if DOT_BF16:
                    t = tl.dot(be.to(tl.bfloat16), xe, t)
                    t = tl.dot(bo.to(tl.bfloat16), xo, t)
                else:
                    t = tl.dot(be, xe, t, input_precision=PREC)
                    t = tl.dot(bo, xo, t, input_precision=PREC)
        if HAS_LR:
            at = tl.load(a_ptr + rn64[:, None] * r + rr[None, :], mask=nmask[:, None] & (rr[None, :] < r), other=0.0)
            acc = tl.dot(at, t, acc, input_precision=EPI_PREC)
        omask = nmask[:, None] & tmask[None, :]
        if PARTIAL:
            tl.store(out_ptr + (pid_k * M + rt64[None, :]) * N + rn64[:, None], acc, mask=omask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0)[:, None]
            _mx_store(out_ptr, rt64[None, :] * N + rn64[:, None], acc, omask, OUT_BF16)

    @triton.jit
    def _splitk_reduce_kernel(
        ws_ptr,
        bias_ptr,
        y_ptr,
        MN,
        N,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # y = sum over the splits of ws[s] in split order (deterministic), + bias, rounded to y's dtype
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
        _mx_store(y_ptr, offs, acc, mask, OUT_BF16)

    return {
        "quantize": _quantize_kernel,
        "dequantize": _dequantize_kernel,
        "mx_linear": _mx_linear_kernel,
        "mx_decode": _mx_decode_kernel,
        "splitk_reduce": _splitk_reduce_kernel,
    }
