"""MXFP4 format (crucible.quant.mxfp4): codes, scales, packing, edge values, error bound, and
bit-for-bit agreement with torchao's MX implementation."""

import logging
import math

import pytest
import torch

from crucible.quant.mxfp4 import (
    BLOCK,
    E2M1_VALUES,
    MXFP4Tensor,
    dequantize,
    max_abs_error_bound,
    pack_codes,
    pow2,
    quantize,
    unpack_codes,
)


def block(*values, fill=0.0):
    row = list(values) + [fill] * (BLOCK - len(values))
    return torch.tensor([row], dtype=torch.float32)


def f32_next(x: float, toward: float) -> float:
    """The float32 neighbour of x toward `toward` (math.nextafter works in float64)."""
    return torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(toward, dtype=torch.float32)).item()


def codes_of(q):
    return unpack_codes(q.packed)


def test_all_16_codes_round_trip():
    # scale 1 (amax 6 -> floor(log2 6) - 2 = 0): every E2M1 value is exact
    vals = torch.tensor(E2M1_VALUES * 2, dtype=torch.float32).view(1, 32)
    q = quantize(vals)
    assert q.scales.tolist() == [[127]]
    assert codes_of(q).view(-1).tolist() == list(range(16)) * 2
    back = dequantize(q)
    assert torch.equal(back, vals) and torch.equal(torch.signbit(back), torch.signbit(vals))  # -0.0 keeps its sign


def test_known_block_exact_bytes():
    q = quantize(block(0.5, -1.0, 3.0, 0.25))
    assert q.scales.item() == 126
    assert q.packed[0, :2].tolist() == [2 | (12 << 4), 7 | (1 << 4)]
    assert q.packed[0, 2:].tolist() == [0] * 14
    assert dequantize(q)[0, :4].tolist() == [0.5, -1.0, 3.0, 0.25]


@pytest.mark.parametrize(
    "x, expect",
    [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (f32_next(0.25, 0), 0.0),
        (f32_next(0.25, 1), 0.5),
        (f32_next(0.75, 0), 0.5),
        (f32_next(5.0, 6), 6.0),
        (-0.75, -1.0),
        (-5.0, -4.0),
    ],
)
def test_ties_round_to_the_even_code(x, expect):
    # amax 6 in the block fixes the scale at 1, so the element is rounded as it stands
    q = quantize(block(6.0, x))
    assert q.scales.item() == 127
    assert dequantize(q)[0, 1].item() == expect


def test_floor_mode_edges():
    # amax a power of two: 4 -> scale 1, 4 exact; just above -> the same scale
    assert quantize(block(4.0)).scales.item() == 127
    assert quantize(block(f32_next(4.0, 8.0))).scales.item() == 127
    assert quantize(block(f32_next(4.0, 0.0))).scales.item() == 126
    # floor mode clips: amax 7.9 with scale 1 saturates to 6
    q = quantize(block(7.9, 1.0))
    assert q.scales.item() == 127 and dequantize(q)[0, :2].tolist() == [6.0, 1.0]
    # one large outlier: the small elements of its block flush to zero
    q = quantize(block(1000.0, 1.0, -3.0, 20.0))
    assert q.scales.item() == 127 + 9 - 2
    assert dequantize(q)[0, :4].tolist() == [768.0, 0.0, -0.0, 0.0]  # 1000 / 128 = 7.8 clips to 6
    # tiny and huge
    assert quantize(block(1e-30)).scales.item() == 127 + math.floor(math.log2(1e-30)) - 2
    q = quantize(block(3e38, -3e38))
    assert q.scales.item() == 252 and torch.isfinite(dequantize(q)).all()


def test_ceil_mode_never_clips_and_picks_the_smallest_such_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q = quantize(x, mode="ceil")
    blocks = x.view(64, -1, BLOCK).abs().amax(-1)
    scale = pow2(q.scales.to(torch.int32) - 127)
    assert (blocks / scale <= 6.0).all()  # no element exceeds 6 * scale: nothing clips
    assert (blocks / (scale / 2) > 6.0).all()  # half the scale would clip: it is the smallest
    assert quantize(block(6.0), mode="ceil").scales.item() == 127
    assert quantize(block(6.01), mode="ceil").scales.item() == 128
    assert quantize(block(7.9), mode="ceil").scales.item() == 128  # floor gives 127 and clips
    err = (dequantize(q) - x).abs()
    assert (err <= max_abs_error_bound(x, "ceil") * (1 + 1e-6)).all()


def test_zero_nan_inf_subnormal_blocks():
    x = torch.zeros(5, 32)
    x[1, 3] = float("nan")
    x[1, 4] = 2.0
    x[2, 0] = float("inf")
    x[2, 1] = -1.0
    x[3, 0] = -float("inf")
    x[4, :4] = torch.tensor([1e-40, -2e-40, 0.0, 5e-41])  # float32 subnormals
    q = quantize(x)
    assert q.scales[:, 0].tolist() == [0, 255, 253, 253, 0]
    back = dequantize(q)
    assert torch.equal(back[0], torch.zeros(32))  # all-zero block: exact zeros
    assert back[1].isnan().all()  # NaN anywhere: the whole block is NaN
    assert back[2, 0].item() == float("inf") and back[2, 1].item() == 0.0  # inf round-trips, the rest flush
    assert back[3, 0].item() == -float("inf")
    assert dequantize(q, torch.bfloat16)[2, 0].item() == float("inf")
    # subnormal-only block: scale 2^-127, far above its elements, which round to +-0 (sign kept)
    assert torch.equal(back[4], torch.zeros(32)) and torch.signbit(back[4, 1]).item()
    # a subnormal block that fills its scale: 2^-128 and 2^-127 * 6 are codes 1 and 7 at scale 2^-127
    y = block(2.0**-128, 2.0**-127 * 3)
    qy = quantize(y)
    assert qy.scales.item() == 0 and torch.equal(dequantize(qy), y)
    cods = codes_of(q)
    assert cods[1, 3].item() == 3 and cods[1, 4].item() == 0


def test_dequantize_error_within_the_format_bound():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 512, generator=g) * 0.05
    x[0, 7] = 3.0  # an outlier
    err = (dequantize(quantize(x)) - x).abs()
    bound = max_abs_error_bound(x)
    assert (err <= bound * (1 + 1e-6)).all()
    # the bound is tight: some element reaches at least half of it
    assert (err / bound.clamp(min=1e-30)).max() > 0.5
    # and MXFP4's relative error on gaussian weights is what the format gives (~10-20%)
    rel = (err.norm() / x.norm()).item()
    assert 0.05 < rel < 0.25


def test_packing_round_trip_and_validation():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (3, 7, 64), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (3, 7, 32)
    assert torch.equal(unpack_codes(packed), codes)
    assert packed[0, 0, 0].item() == codes[0, 0, 0].item() | (codes[0, 0, 1].item() << 4)
    with pytest.raises(ValueError, match="uint8 codes < 16"):
        pack_codes(torch.full((2, 4), 16, dtype=torch.uint8))


def test_shapes_padding_and_bad_input():
    x = torch.randn(2, 3, 64)
    q = quantize(x)
    assert q.packed.shape == (2, 3, 32) and q.scales.shape == (2, 3, 2) and q.shape == (2, 3, 64)
    assert q.nbytes() * 8 / x.numel() == 4.25
    with pytest.raises(ValueError, match=r"last dimension of shape \[4, 40\] is 40, not a multiple of 32"):
        quantize(torch.randn(4, 40))
    qp = quantize(torch.randn(4, 40), pad=True)
    assert qp.packed.shape == (4, 32) and qp.shape == (4, 40) and dequantize(qp).shape == (4, 40)
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize(x, mode="round")
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected packed \[2, 32\]"):
        MXFP4Tensor(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), (2, 64))
    # bf16 input gives the same result as its float32 upcast
    xb = torch.randn(8, 64).to(torch.bfloat16)
    assert torch.equal(quantize(xb).packed, quantize(xb.float()).packed)


# ---------------------------------------------------------------------------------------------------
# torchao agreement


@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    def run(x):
        s, d = to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.FLOOR)
        v = to_dtype(d, s, torch.float4_e2m1fn_x2, 32, torch.float32)
        return s.view(torch.uint8), d.view(torch.uint8), v

    return run


def _edge_tensor():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 64, generator=g)
    x[0] = 0.0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * torch.tensor([1.0, -1.0] * 16)
    x[2, 5] = float("nan")
    x[3, 0], x[3, 40] = float("inf"), -float("inf")
    x[4] *= 1e30
    x[5] *= 1e-30
    x[6, :] = -0.0
    x[7, 3] = 3e38
    x[8, :32] = 4.0
    x[8, 32:] = torch.tensor([f32_next(4.0, 8.0)] * 32)
    x[9, 10] = 500.0  # an outlier
    x[10] = torch.tensor([2.0**k for k in range(-20, 44)])
    return x


@pytest.mark.parametrize("case", ["random", "wide", "edges", "bf16"])
def test_bit_exact_with_torchao(torchao_mx, case):
    g = torch.Generator().manual_seed(4)
    x = {
        "random": lambda: torch.randn(96, 384, generator=g) * 0.04,
        "wide": lambda: torch.randn(16, 512, generator=g) * torch.logspace(-8, 8, 16).unsqueeze(1),
        "edges": _edge_tensor,
        "bf16": lambda: (torch.randn(32, 128, generator=g) * 3).to(torch.bfloat16),
    }[case]()
    s, d, v = torchao_mx(x)
    q = quantize(x)
    assert torch.equal(q.scales, s)
    assert torch.equal(q.packed, d)
    mine = dequantize(q)
    assert torch.equal(mine.isnan(), v.isnan())
    assert torch.equal(torch.nan_to_num(mine), torch.nan_to_num(v))
    assert torch.equal(torch.signbit(mine[~mine.isnan()]), torch.signbit(v[~v.isnan()]))


def test_documented_difference_from_torchao_for_blocks_below_2_pow_minus_125(torchao_mx):
    # scale byte 0 with non-zero elements: torchao quantizes with 2^-126 and dequantizes with 2^-127
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0**-126 * 0.75  # a normal float32 whose block gets scale byte 0
    s, d, v = torchao_mx(x)
    q = quantize(x)
    assert q.scales.item() == s.item() == 0
    assert v[0, 0].item() == pytest.approx(x[0, 0].item() / 2, rel=0.34)  # torchao halves it
    assert dequantize(q)[0, 0].item() == pytest.approx(x[0, 0].item(), rel=0.34)  # ours keeps it


def test_nan_block_codes_come_from_x_itself():
    # the same bytes on every device: sign bit of x, magnitude 3 for NaN and +-inf, 0 otherwise
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan"), -1.0, 2.0])
    q = quantize(x)
    assert q.scales.item() == 255
    assert codes_of(q)[0, :6].tolist() == [3, 3, 11, 11, 8, 0]
    assert dequantize(q).isnan().all()


@pytest.mark.parametrize("mode", ["floor", "ceil"])
def test_huge_finite_blocks_never_overflow(mode):
    big = torch.finfo(torch.float32).max
    x = block(big, -big, 3e38, 2.6e38, 1.0)
    q = quantize(x, mode=mode)
    assert q.scales.item() <= 252
    back = dequantize(q)
    assert torch.isfinite(back).all()
    assert back[0, 0].item() == 6 * 2.0**125 and back[0, 1].item() == -6 * 2.0**125
