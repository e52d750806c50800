"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, E8M0 block scales), the torch path (docs/methods.md, quantize).

    q = quantize(w)                 # MXFP4Tensor: packed uint8 [..., K // 2], scales uint8 [..., K // 32]
    w_hat = dequantize(q)           # float32 (or dtype=...) of w's shape

Format
- Blocks of 32 consecutive elements along the last dimension share one scale. K (the last
  dimension) must be a multiple of 32, or `pad=True` zero-pads it and records the true K in
  `shape` (dequantize drops the padding).
- Elements: E2M1, code = sign << 3 | magnitude code; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for
  codes 0..7 (`E2M1_VALUES` lists all 16). Code 8 is -0.
- Packing: two codes per byte, the even-index element in the low nibble, the odd-index element in
  the high nibble (torchao's `pack_uint4`; Triton's `triton_kernels` uses the same order).
- Scales: E8M0, a biased exponent b in 0..254 meaning 2^(b - 127); 255 means NaN.

Scale modes (amax = max |x| over the block, in float32)
- "floor" (the OCP spec's, and torchao's ScaleCalculationMode.FLOOR): 2^(floor(log2(amax)) - 2),
  floor(log2) read from the float32 exponent bits. amax / scale lies in [4, 8): elements above 6
  saturate to +-6 (the format's known clipping).
- "ceil" (never clips; triton_kernels' ROUND_UP): 2^ceil(log2(amax / 6)), amax / 6 rounded to
  float32 first; amax / scale lies in (3, 6]. Capped at 2^125 for finite blocks: at 2^126 the
  grid's 4 and 6 times the scale overflow float32, so a block with amax above 6 * 2^125
  (about 2.55e38) saturates at 6 * 2^125 rather than rounding to inf.
- The exponent is clamped to [-127, 127]: b = 0 for an all-zero block, for subnormal-only
  blocks and anything below 2^-125; a finite amax never reaches b = 255 (floor: b <= 252).

Elements: x / scale (computed as x * 2^-e, which is the same correctly rounded float32 value),
rounded to the nearest E2M1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at +-6. The sign is kept, so a negative value
that rounds to zero is code 8 (-0).

Special values, all defined and tested:
- all-zero block: scale byte 0 and codes 0 (dequantizes to exact zeros);
- NaN anywhere in a block: scale byte 255, so the whole block dequantizes to NaN; each element
  gets code sign(x) << 3 | (3 if x is NaN or +-inf else 0), from x's own sign bit, the same on
  every device (torchao's cast of x / inf gives the same codes for finite and NaN elements on
  x86; for +-inf elements it gives the sign of the device's default NaN);
- +-inf (no NaN in the block): amax = inf gives b = 253 in floor mode (2^126; 254 in ceil
  mode), inf saturates to code 7 (+-6 * 2^126, which is inf again in float32 and bfloat16):
  inf round-trips to inf. The block's finite elements are scaled by 2^-126 like any others:
  below 2^123 they flush to +-0, and from about 2.98e38 they round to 4 * 2^126 = inf (as in
  torchao);
- huge finite values (up to float32 max) in a block without inf: floor b <= 252 and ceil
  b <= 252 (the cap above), no overflow;
- subnormal float32 inputs: their block gets b = 0 (2^-127); elements are scaled by 2^127 exactly.

Agreement with torchao (`torchao.prototype.mx_formats.mx_tensor.to_mx(x, torch.float4_e2m1fn_x2,
32, ScaleCalculationMode.FLOOR)` and `to_dtype`): identical scale bytes, packed bytes and
dequantized values for every input, with one deliberate difference: a block whose scale byte is 0
but which is not all zero (amax < 2^-125). torchao then divides by 2^-126 (it clamps the float
scale to the smallest normal float32) but multiplies back by 2^-127, so its round trip halves the
block; here the elements are scaled by the scale the byte encodes, 2^-127, and the round trip is
consistent.

Speed on CPU: the block scale comes from the exponent bits of amax (a tensor K/32 times smaller),
the elements are scaled by a multiplication, and the E2M1 cast counts the rounding midpoints below
each magnitude (seven compares into one reused buffer; a tie counts where it rounds up to the even
code); dequantization is one lookup of a 256 x 2 table per packed byte times the block scale.
No Python loop over blocks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
MODES = ("floor", "ceil")

# value of each 4-bit code: sign << 3 | magnitude
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
_EMAX = 2  # floor(log2(6))
_CEIL_EMAX = 125  # the largest scale exponent whose E2M1 grid (up to 6 * 2^e) is finite in float32


# The midpoints between consecutive E2M1 magnitudes, and whether a tie there rounds up (to the
# even code above: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4) or down (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_magnitudes(a: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 magnitude codes of float32 magnitudes already divided by their scale: the number of
    midpoints below a (a tie counts when it rounds up), saturating at 7 (6.0) and 7 for inf; NaN
    gets an unspecified code (the caller replaces NaN blocks). Seven compares into one reused
    buffer, each added as its bytes: a quarter of the time of torch.bucketize, a binary search."""
    mag = torch.gt(a, _MIDPOINTS[0][0]).view(torch.uint8)
    buf = torch.empty(a.shape, dtype=torch.bool, device=a.device)
    for mid, up in _MIDPOINTS[1:]:
        (torch.ge if up else torch.gt)(a, mid, out=buf)
        mag += buf.view(torch.uint8)
    return mag


_LUT16 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# byte -> (value of the low nibble, value of the high nibble)
_LUT256 = torch.stack([_LUT16[torch.arange(256) & 0xF], _LUT16[torch.arange(256) >> 4]], dim=1).contiguous()


@dataclass
class MXFP4Tensor:
    """A tensor in MXFP4. packed: uint8 [..., Kp // 2]; scales: uint8 [..., Kp // 32] (E8M0 biased
    exponents); shape: the original shape (its last entry K <= Kp when padded); mode: the scale mode."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    mode: str = "floor"

    def __post_init__(self):
        self.shape = tuple(int(s) for s in self.shape)
        check_packed(self.packed, self.scales, self.shape, where="MXFP4Tensor")

    @property
    def padded_k(self) -> int:
        return self.packed.shape[-1] * 2

    def nbytes(self) -> int:
        """Bytes of the packed codes and the scales (4.25 bits per element when K % 32 == 0)."""
        return self.packed.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def check_packed(packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], where: str) -> None:
    """Raise ValueError naming `where` unless packed/scales are uint8 of the shapes `shape` implies."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{where}: packed and scales must be torch.uint8, got {packed.dtype} and {scales.dtype}")
    if len(shape) == 0:
        raise ValueError(f"{where}: MXFP4 needs at least one dimension, got shape ()")
    k = shape[-1]
    kp = -(-k // BLOCK) * BLOCK
    lead = tuple(shape[:-1])
    if tuple(packed.shape) != (*lead, kp // 2) or tuple(scales.shape) != (*lead, kp // BLOCK):
        raise ValueError(
            f"{where}: for shape {list(shape)} expected packed {[*lead, kp // 2]} and scales "
            f"{[*lead, kp // BLOCK]}, got {list(packed.shape)} and {list(scales.shape)}"
        )


def pow2(n: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^n for integer n in [-127, 127], built from its bits (2^-127 is subnormal)."""
    n = n.to(torch.int32)
    bits = torch.where(n > -127, (n + 127) << 23, torch.full_like(n, 1 << 22))
    return bits.view(torch.float32)


def _block_exponent(amax: torch.Tensor, mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32) of each block from its float32 amax, clamped to [-127, 127]."""
    if mode == "floor":
        e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - _EMAX
    else:
        # ceil(log2(amax / 6)): round the float32 quotient's bits up to the next power of two
        bits = (amax / E2M1_MAX).view(torch.int32)
        e = (((bits + 0x7FFFFF) >> 23) & 0xFF) - 127
        # above 2^125 the E2M1 grid's 4 and 6 times the scale overflow float32: cap finite blocks
        e = torch.where(torch.isinf(amax), e, e.clamp(max=_CEIL_EMAX))
    return e.clamp_(-E8M0_BIAS, E8M0_BIAS)


def quantize(x: torch.Tensor, mode: str = "floor", pad: bool = False) -> MXFP4Tensor:
    """x (any float dtype, last dimension K) -> MXFP4Tensor. See the module docstring for the format.

    K must be a multiple of 32 unless pad=True (then zero-padded; `shape` keeps the true K).
    Raises ValueError for an unknown mode, a non-float or 0-d tensor, or K % 32 != 0 without pad.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize expects at least one dimension, got a 0-d tensor")
    shape = tuple(x.shape)
    k = shape[-1]
    if k % BLOCK:
        if not pad:
            raise ValueError(
                f"the last dimension of shape {list(shape)} is {k}, not a multiple of {BLOCK}; "
                f"pass pad=True to zero-pad it to {-(-k // BLOCK) * BLOCK}"
            )
        x = torch.nn.functional.pad(x, (0, -(-k // BLOCK) * BLOCK - k))
    x = x.to(torch.float32).contiguous()
    lead = x.shape[:-1]
    blocks = x.view(*lead, -1, BLOCK)
    a = blocks.abs()  # reused: the block amax, then (scaled in place) the magnitudes to round
    amax = a.amax(-1)
    e = _block_exponent(amax, mode)
    nan_block = torch.isnan(amax)
    scales = torch.where(nan_block, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8)
    # 2^-e as float32 bits (e in [-127, 127] -> 2^-e in [2^-127, 2^127], all exact); a NaN block is
    # scaled by 0 so its finite elements become +-0, as torchao's division by inf gives. |x| * 2^-e
    # rounds as |x * 2^-e| does, and x * 2^-e has x's sign (2^-e > 0), so the sign bit comes from x
    inv = pow2(-e).masked_fill_(nan_block, 0.0)
    codes = _e2m1_magnitudes(a.mul_(inv.unsqueeze(-1)))
    codes.add_(torch.signbit(blocks).view(torch.uint8), alpha=8)
    if nan_block.any():
        # defined from x itself, not from x * 0 (whose NaN sign differs between devices)
        special = (torch.signbit(blocks).to(torch.uint8) << 3) | torch.where(torch.isfinite(blocks), 0, 3).to(
            torch.uint8
        )
        codes = torch.where(nan_block.unsqueeze(-1), special, codes)
    codes = codes.reshape(*lead, -1)
    if sys.byteorder == "little":
        # each pair of codes as one int16 (even code in the low byte): v | v >> 4 holds
        # even | odd << 4 in its low byte, which the cast to uint8 keeps
        v = codes.view(torch.int16)
        packed = (v | (v >> 4)).to(torch.uint8)
    else:
        pairs = codes.view(*lead, -1, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return MXFP4Tensor(packed.contiguous(), scales.contiguous(), shape, mode)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """float32 2^(b - 127) of each E8M0 byte; NaN for 255."""
    s = pow2(scales.to(torch.int32) - E8M0_BIAS)
    return s.masked_fill_(scales == E8M0_NAN, float("nan"))


def dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values q encodes, in `dtype` (computed in float32, then cast), of shape q.shape."""
    lead = q.packed.shape[:-1]
    pairs = torch.nn.functional.embedding(q.packed.to(torch.int32), _LUT256.to(q.packed.device))
    values = pairs.view(*lead, -1, BLOCK) * scale_values(q.scales).unsqueeze(-1)
    values = values.view(*lead, q.padded_k)
    if q.padded_k != q.shape[-1]:
        values = values[..., : q.shape[-1]]
    return values.to(dtype)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> the 4-bit codes uint8 [..., K] (even index from the low nibble)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..., K] (K even, values < 16) -> uint8 [..., K // 2]."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2 or bool((codes > 15).any()):
        raise ValueError(
            f"pack_codes expects uint8 codes < 16 with an even last dimension, got {codes.dtype} "
            f"of shape {list(codes.shape)}"
        )
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def max_abs_error_bound(x: torch.Tensor, mode: str = "floor") -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| for finite x: half the E2M1 spacing at
    |x| / scale (0.25, 0.5 or 1 times the scale), or, for an element that floor mode clips,
    |x| - 6 * scale. Same shape as x (K a multiple of 32)."""
    x = x.to(torch.float32)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    e = _block_exponent(blocks.abs().amax(-1), mode)
    scale = pow2(e).unsqueeze(-1)
    r = blocks.abs() / scale
    half_step = torch.where(r < 2, 0.25, torch.where(r < 4, 0.5, 1.0))
    bound = torch.where(r > E2M1_MAX, r - E2M1_MAX, half_step) * scale
    return bound.reshape(x.shape)
