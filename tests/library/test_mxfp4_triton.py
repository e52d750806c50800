"""The MXFP4 Triton kernels (crucible/quant/triton_kernels.py) against the torch path (mxfp4.py).

The kernels run under the Triton interpreter (TRITON_INTERPRET=1 must be set before triton is first
imported, so that check runs in a fresh subprocess, on small shapes). Argument validation happens
before any launch and is tested in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from crucible.quant import triton_checks
from crucible.quant import triton_kernels as tk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INTERPRETER_SCRIPT = textwrap.dedent(r'''
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import math
    import numpy as np
    np.seterr(all="ignore")   # the interpreter's numpy overflows to inf on purpose (huge blocks)
    import torch
    from crucible.quant import mxfp4 as ref
    from crucible.quant import triton_kernels as tk

    g = torch.Generator().manual_seed(0)
    NAN, INF = float("nan"), float("inf")

    def bits(t):
        return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])

    def same_bits(a, b, nan_payload=True):
        # bit equality; nan_payload=False: NaN at the same places, every other element bit-equal
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if nan_payload:
            return torch.equal(bits(a), bits(b))
        na, nb = torch.isnan(a), torch.isnan(b)
        return torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb])

    def edge_blocks():
        """Blocks of 32 that exercise every special case of the format."""
        blocks = []
        def blk(vals, fill=0.0):
            v = list(vals) + [fill] * (32 - len(vals))
            blocks.append(v[:32])
        blk([])                                                   # all +0
        blk([], fill=-0.0)                                        # all -0
        blk([NAN, -NAN, INF, -INF, 1.0, -1.0, -0.0, 0.0, 3.0], fill=0.5)   # NaN with everything
        blk([NAN])                                                # one NaN, zeros
        blk([-NAN, 2.0, -3.0], fill=-0.0)
        blk([INF, 1.0, -2.0, 0.0, -0.0, 3e38])                    # inf flushes finite elements
        blk([-INF, 5.0, -7.0], fill=-1e-3)
        blk([INF, -INF, 1.0])
        ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
        exact = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        for s in (2.0 ** 3, 2.0 ** -10, 2.0 ** 100):              # amax 6 s: scale s in both modes
            blk([6 * s] + [t * s for t in ties] + [-t * s for t in ties] + [-v * s for v in exact])
            blk([6 * s] + [math.nextafter(t, 0) * s for t in ties] + [math.nextafter(t, 9) * s for t in ties]
                + [-math.nextafter(t, 9) * s for t in ties])
        blk([7.9, -7.0, 6.5, 6.0, 5.9, -0.1])                     # floor mode saturates
        blk([4.0, 3.0, -2.0, 1e-3, -1e-3])                        # amax a power of two; tiny -> +-0
        blk([1e-39, -1e-39, 2.0 ** -127, 1.1e-38, -(2.0 ** -149), 2.0 ** -148, -5e-39])   # subnormal only
        blk([2.0 ** -126, 1.5 * 2.0 ** -126, -(2.0 ** -125), 1e-39])   # tiny normals (clamped exponent)
        blk([1e-39, 1.0, -1e-39])                                  # subnormals next to a normal
        blk([3e38, -3.4028234663852886e38, 1e38, 2e37, -5e37, 1.0])    # huge, float32 max
        blk([3.4028234663852886e38, 3.0e38, -2.9e38])
        blk([1.0, -1.0] * 16)
        blk([6.0 * 2.0 ** 126, -3.0 * 2.0 ** 126])                 # largest exponents
        blk([0.3, -0.7, 1.3, 2.6, -4.4, 5.5, -0.01, 0.126])
        return torch.tensor(blocks, dtype=torch.float32)

    def check_quantize(x, mode, **kw):
        p, s = tk.quantize(x, mode, **kw)
        q = ref.quantize(x, mode)
        assert p.shape == q.packed.shape and s.shape == q.scales.shape, (p.shape, s.shape)
        assert torch.equal(s, q.scales), (mode, x.dtype, (s != q.scales).nonzero()[:5])
        assert torch.equal(p, q.packed), (mode, x.dtype, (p != q.packed).nonzero()[:5])
        return q

    # --- quantize: random tensors (wide range of magnitudes), three input dtypes, 2-D and 3-D
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        rows = torch.logspace(-30 if dt != torch.float16 else -3, 30 if dt != torch.float16 else 3, 7)
        x = (torch.randn(7, 160, generator=g) * rows[:, None]).to(dt)
        for mode in ("floor", "ceil"):
            check_quantize(x, mode, block_b=8)   # 35 blocks: several programs and a masked tail
            check_quantize(x.reshape(7, 5, 32)[:, :, :].transpose(0, 1), mode)   # non-contiguous 3-D
    check_quantize(torch.randn(3, 64, generator=g, dtype=torch.float64), "floor")   # cast to float32 first

    # --- quantize: edge blocks, float32 and bfloat16, both modes
    e = edge_blocks()
    x = e.reshape(-1, 64)          # two blocks per row
    seen = {}
    for dt in (torch.float32, torch.bfloat16):
        for mode in ("floor", "ceil"):
            q = check_quantize(x.to(dt), mode, block_b=4)
            seen[(dt, mode)] = q
    q = seen[(torch.float32, "floor")]
    codes = ref.unpack_codes(q.packed)
    sc = set(q.scales.flatten().tolist())
    assert {0, 255, 253}.issubset(sc), sorted(sc)          # zero/subnormal, NaN, inf blocks present
    cs = set(codes.flatten().tolist())
    assert {0, 8, 3, 7, 15}.issubset(cs), sorted(cs)       # +0, -0, NaN, +-6 codes present
    assert 254 in set(seen[(torch.float32, "ceil")].scales.flatten().tolist())
    # the tie block really rounds to even (and the test data really has ties)
    tie = ref.unpack_codes(ref.quantize(e[8:9], "floor").packed)[0, 1:8].tolist()
    assert tie == [0, 2, 2, 4, 4, 6, 6], tie

    # --- dequantize: every byte value, every scale byte (0, 254 and the NaN scale 255 included)
    packed = torch.arange(256, dtype=torch.uint8).repeat(16, 1)            # (16, 256): k = 512
    scales = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    qa = ref.MXFP4Tensor(packed, scales, (16, 512))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        d = tk.dequantize(packed, scales, 512, dt, block_b=32)
        assert d.dtype == dt and d.shape == (16, 512)
        # float32 including NaN payloads; bf16/fp16: NaN patterns are the cast's own (torch's CPU
        # bf16 cast gives 0xFFFF vectorised, 0x7FC0 scalar), everything else bit-equal
        assert same_bits(d, ref.dequantize(qa, dt), nan_payload=dt == torch.float32), dt
    assert torch.isnan(d).any() and torch.isinf(d).any() and (d == 0).any()
    for (dt, mode), q in seen.items():
        for odt in (torch.float32, torch.bfloat16):
            d = tk.dequantize(q.packed, q.scales, q.shape[-1], odt)
            assert same_bits(d, ref.dequantize(q, odt), nan_payload=odt == torch.float32), (dt, mode, odt)
    q3 = ref.quantize(torch.randn(2, 3, 96, generator=g), "ceil")
    d = tk.dequantize(q3.packed, q3.scales, 96)
    assert d.shape == (2, 3, 96) and same_bits(d, ref.dequantize(q3))
    assert tk.dequantize(q3.packed, q3.scales, 96, torch.float64).dtype == torch.float64

    # --- mx_linear: x @ W^T (+ bias) (+ x @ b^T @ a^T) against a float64 reference
    def reference(x, q, bias, a, b):
        xd = x.double()
        y = xd @ ref.dequantize(q).double().T
        if bias is not None:
            y = y + bias.double()
        if a is not None:
            bb = b.to(x.dtype).double()            # b is rounded to x's dtype (bf16 tensor cores)
            y = y + (xd @ bb.T) @ a.double().T
        return y

    shapes = [  # (lead dims of x, N, K, blocks)
        ((37,), 45, 96, dict(block_m=16, block_n=32, block_k=32)),   # nothing a multiple of a block
        ((2, 5), 20, 160, dict(block_m=16, block_n=16, block_k=64)),  # 3-D x, K % BLOCK_K != 0
        ((1,), 33, 64, dict(block_m=16, block_n=32, block_k=32)),     # one row
        ((40,), 70, 128, {}),                                          # default blocks
    ]
    for lead, n, k, blocks in shapes:
        w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[:, None]
        q = ref.quantize(w, "floor")
        x = torch.randn(*lead, k, generator=g)
        bias = torch.randn(n, generator=g) * 30
        r = 5 if k != 64 else 17                                        # R padded to 16 and to 32
        a = torch.randn(n, r, generator=g)
        b = torch.randn(r, k, generator=g)
        for with_bias in (False, True):
            for with_lr in (False, True):
                args = (bias if with_bias else None, a if with_lr else None, b if with_lr else None)
                y = tk.mx_linear(x, q.packed, q.scales, k, *args, **blocks)
                want = reference(x, q, *args)
                assert y.dtype == torch.float32 and y.shape == (*lead, n), (y.dtype, y.shape)
                torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
                # the terms under test exceed the tolerance tenfold (leaving one out would fail)
                if with_lr:
                    lr = (x.double() @ b.double().T) @ a.double().T
                    assert lr.abs().max() > 1e-3 * want.abs().max()
                if with_bias:
                    assert bias.abs().max() > 1e-3 * want.abs().max()
                # bfloat16 x: bf16 output, looser tolerance (one bf16 rounding of the result)
                xb = x.to(torch.bfloat16)
                yb = tk.mx_linear(xb, q.packed, q.scales, k, *args, **blocks)
                wantb = reference(xb, q, *args)
                assert yb.dtype == torch.bfloat16 and yb.shape == (*lead, n)
                torch.testing.assert_close(yb.double(), wantb, rtol=1e-2, atol=1e-2 * wantb.abs().max().item())
    # the decode kernel (up to 16 rows, block_m unset): split-K with a split boundary inside an MX
    # block step, K not a multiple of the K step, 3-D x, wide N tiles, the default split of a long K
    decode = [  # (lead dims of x, N, K, options)
        ((1,), 45, 96, {}),
        ((5,), 70, 320, dict(split_k=3, block_k=32)),
        ((2, 3), 33, 512, dict(split_k=4, block_k=64)),
        ((16,), 130, 256, dict(block_n=128)),
        ((7,), 20, 4096, {}),
    ]
    from crucible.quant import triton_decode as td
    assert td.decode_config(20, 4096, torch.device("cpu"))["split_k"] > 1   # the last case splits K
    for lead, n, k, opts in decode:
        wd = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[:, None]
        qd = ref.quantize(wd, "floor")
        x = torch.randn(*lead, k, generator=g)
        a, b = torch.randn(n, 5, generator=g), torch.randn(5, k, generator=g)
        for args in ((None, None, None), (torch.randn(n, generator=g) * 30, a, b)):
            for xd, tol in ((x, 1e-4), (x.to(torch.bfloat16), 1e-2)):
                y = tk.mx_linear(xd, qd.packed, qd.scales, k, *args, **opts)
                want = reference(xd, qd, *args)
                assert y.dtype == xd.dtype and y.shape == (*lead, n), (y.dtype, y.shape)
                torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # a device where the decode kernel does not build (here: too much shared memory): one warning,
    # the tiled kernel from then on, the same result; an explicit split_k gets the error itself
    import warnings
    from triton.runtime.errors import OutOfResources
    real, calls = td.launch, []
    def no_room(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")
    td.launch = no_room
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        xs4 = torch.randn(4, 96, generator=g)
        tiled = tk.mx_linear(xs4, q.packed[:, :48].contiguous(), q.scales[:, :3].contiguous(), 96, block_m=16)
        for _ in range(2):
            got = tk.mx_linear(xs4, q.packed[:, :48].contiguous(), q.scales[:, :3].contiguous(), 96)
            assert torch.equal(got, tiled)
    from crucible.device import UNBUILT
    assert len(calls) == 1 and ("mx_linear: the MXFP4 decode kernel", "cpu") in UNBUILT, (calls, UNBUILT)
    assert [str(w.message) for w in seen if "decode kernel did not build" in str(w.message)], seen
    try:
        tk.mx_linear(xs4, q.packed[:, :48].contiguous(), q.scales[:, :3].contiguous(), 96, split_k=2)
        raise AssertionError("an explicit split_k must not fall back")
    except OutOfResources:
        pass
    td.launch = real
    UNBUILT.clear()
    # a NaN block in the second split makes its row NaN, and no other (masked tails read no scale)
    wn = torch.randn(8, 256, generator=g)
    wn[3, 200] = float("nan")
    qn = ref.quantize(wn)
    xn = torch.randn(2, 256, generator=g)
    yn = tk.mx_linear(xn, qn.packed, qn.scales, 256, split_k=2, block_k=64)
    assert torch.equal(torch.isnan(yn), torch.isnan(reference(xn, qn, None, None, None)))
    assert torch.isnan(yn[:, 3]).all() and not torch.isnan(yn[:, [0, 1, 2, 4, 5, 6, 7]]).any()
    # exact case: integer x and W (scale 1), so every partial sum is an exact float32 integer in any
    # order; many results are bfloat16 ties (round to nearest even, not half away from zero)
    wi = torch.tensor([0., 1., 2., 3., 4., 6.])[torch.randint(0, 6, (24, 64), generator=g)]
    wi = wi * torch.where(torch.rand(24, 64, generator=g) < 0.5, -1.0, 1.0)
    wi[:, 0] = 6.0
    qi = ref.quantize(wi)
    assert torch.equal(ref.dequantize(qi), wi)
    xi = torch.randint(-8, 9, (19, 64), generator=g).float()
    exact = xi.double() @ wi.double().T
    assert (exact.float().view(torch.int32) & 0xFFFF == 0x8000).any()      # there are ties
    for dt in (torch.float32, torch.bfloat16):
        y = tk.mx_linear(xi.to(dt), qi.packed, qi.scales, 64, block_m=16, block_n=16, block_k=32)
        assert same_bits(y, exact.to(dt)), dt
        # the decode kernel, split in two and whole (its rows 0..15)
        for split in (1, 2):
            y = tk.mx_linear(xi[:16].to(dt), qi.packed, qi.scales, 64, split_k=split, block_k=32)
            assert same_bits(y, exact[:16].to(dt)), (dt, split)
    # a zero-row x gives an empty result
    assert tk.mx_linear(torch.empty(0, 64), q.packed[:, :32].contiguous(), q.scales[:, :2].contiguous(),
                        64).shape == (0, 70)
    # MXLinear's two GPU routes, forced here on CPU tensors: the fused kernel within its tolerance of
    # the torch path, the prefill route (Triton dequantization, then the matmul) bit-equal to it
    from crucible.quant import linear as L
    layer = L.MXLinear.from_linear(torch.nn.Linear(64, 24), "floor")
    layer.set_adapter(torch.randn(24, 4, generator=g) * 0.1, torch.randn(4, 64, generator=g) * 0.1)
    with torch.no_grad():
        for rows in (40, 3):  # 3 rows: the fused route runs the decode kernel
            xs = torch.randn(rows, 64, generator=g)
            L.route_for = lambda x, k: "torch"
            want = layer(xs)
            for route in ("fused", "dequant-matmul"):
                L.route_for = lambda x, k, route=route: route
                got = layer(xs)
                if route == "fused":
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
                else:
                    assert torch.equal(got, want), route
    print("MXFP4_TRITON_OK")
''')


def test_triton_interpreter_equals_torch_path():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT
    )
    assert res.returncode == 0 and "MXFP4_TRITON_OK" in res.stdout, (res.stdout[-2000:], res.stderr[-4000:])


def test_module_imports_without_triton():
    # triton made unimportable: the module still imports, available() is False, and a call that gets
    # past validation says triton is missing
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        import torch
        from crucible.quant import triton_kernels as tk
        assert not tk.available()
        assert "triton" not in sys.modules
        try:
            tk.quantize(torch.zeros(2, 32))
        except RuntimeError as e:
            assert "triton" in str(e), e
        else:
            raise AssertionError("no RuntimeError")
        print("NO_TRITON_OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and "NO_TRITON_OK" in res.stdout, res.stderr[-3000:]


U8 = torch.uint8


def _w(n=8, k=64):
    return torch.zeros(n, k // 2, dtype=U8), torch.zeros(n, k // 32, dtype=U8)


BAD_QUANTIZE = [
    (dict(x=torch.zeros(4, 48)), r"last dimension of x .*\[4, 48\]"),
    (dict(x=torch.zeros(4, 0)), r"last dimension of x .*\[4, 0\]"),
    (dict(x=torch.zeros(())), r"last dimension of x .*\[\]"),
    (dict(x=torch.zeros(4, 32, dtype=torch.int32)), r"x must be a floating-point tensor, got torch.int32"),
    (dict(x=torch.zeros(4, 32), mode="round"), r"mode must be one of"),
    (dict(x=torch.zeros(4, 32), block_b=12), r"block_b must be a power of two"),
    (dict(x=[1.0] * 32), r"x must be a torch.Tensor"),
]


@pytest.mark.parametrize("kwargs,match", BAD_QUANTIZE)
def test_quantize_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tk.quantize(**kwargs)


BAD_DEQUANTIZE = [
    (
        dict(packed=torch.zeros(4, 16, dtype=U8), scales=torch.zeros(4, 1, dtype=U8), k=48),
        r"k must be a positive multiple of 32, got 48",
    ),
    (
        dict(packed=torch.zeros(4, 16, dtype=U8), scales=torch.zeros(4, 1, dtype=U8), k=64),
        r"packed must have last dimension k // 2 = 32, got shape \[4, 16\]",
    ),
    (
        dict(packed=torch.zeros(4, 16, dtype=U8), scales=torch.zeros(4, 2, dtype=U8), k=32),
        r"scales must have shape \[4, 1\].*got \[4, 2\]",
    ),
    (
        dict(packed=torch.zeros(4, 16, dtype=U8), scales=torch.zeros(3, 1, dtype=U8), k=32),
        r"scales must have shape \[4, 1\].*got \[3, 1\]",
    ),
    (
        dict(packed=torch.zeros(4, 16, dtype=torch.int8), scales=torch.zeros(4, 1, dtype=U8), k=32),
        r"packed must be torch.uint8, got torch.int8",
    ),
    (
        dict(packed=torch.zeros(4, 16, dtype=U8), scales=torch.zeros(4, 1), k=32),
        r"scales must be torch.uint8, got torch.float32",
    ),
    (
        dict(packed=torch.zeros(4, 16, dtype=U8), scales=torch.zeros(4, 1, dtype=U8), k=32, dtype=torch.int32),
        r"dtype must be a floating-point",
    ),
]


@pytest.mark.parametrize("kwargs,match", BAD_DEQUANTIZE)
def test_dequantize_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tk.dequantize(**kwargs)


def _lin(**over):
    p, s = _w()
    kw = dict(x=torch.zeros(3, 64), packed=p, scales=s, k=64)
    kw.update(over)
    return kw


BAD_LINEAR = [
    (_lin(k=40), r"k must be a positive multiple of 32, got 40"),
    (
        _lin(x=torch.zeros(3, 64, dtype=torch.float16)),
        r"x must be float32 or bfloat16, got torch.float16 \(shape \[3, 64\]\)",
    ),
    (_lin(x=torch.zeros(3, 96)), r"x must have last dimension k = 64, got shape \[3, 96\]"),
    (_lin(packed=torch.zeros(2, 8, 32, dtype=U8)), r"packed must be 2-D .* got shape \[2, 8, 32\]"),
    (_lin(packed=torch.zeros(8, 16, dtype=U8)), r"packed must have last dimension k // 2 = 32, got shape \[8, 16\]"),
    (_lin(scales=torch.zeros(8, 3, dtype=U8)), r"scales must have shape \[8, 2\] .*got \[8, 3\]"),
    (_lin(scales=torch.zeros(8, 2, dtype=torch.int32)), r"scales must be torch.uint8, got torch.int32"),
    (_lin(bias=torch.zeros(7)), r"bias must be a float tensor of shape \[8\], got torch.float32 of shape \[7\]"),
    (_lin(a=torch.zeros(8, 4)), r"pass both a \(N, r\) and b \(r, k\) or neither, got a=\[8, 4\] and b=None"),
    (_lin(a=torch.zeros(7, 4), b=torch.zeros(4, 64)), r"a must have shape \(N, r\) with N = 8, got \[7, 4\]"),
    (_lin(a=torch.zeros(8, 4), b=torch.zeros(4, 32)), r"b must have shape \(r, k\) = \[4, 64\] .*got \[4, 32\]"),
    (_lin(a=torch.zeros(8, 4), b=torch.zeros(5, 64)), r"b must have shape \(r, k\) = \[4, 64\]"),
    (_lin(a=torch.zeros(8, 0), b=torch.zeros(0, 64)), r"rank r = a.shape\[1\] must be in \[1, 128\]"),
    (_lin(a=torch.zeros(8, 200), b=torch.zeros(200, 64)), r"rank r = a.shape\[1\] must be in \[1, 128\]"),
    (_lin(block_m=48), r"block_m must be a power of two >= 16"),
    (_lin(block_k=16), r"block_k must be a power of two >= 32"),
    (_lin(block_n=8), r"block_n must be a power of two >= 16"),
    (_lin(precision="fp16"), r"precision must be one of"),
    (_lin(num_warps=0), r"num_warps must be a positive int"),
    (_lin(split_k=0), r"split_k must be a positive int"),
    (_lin(x=torch.zeros(17, 64), split_k=2), r"split_k is for at most 16 rows of x, got 17"),
    (_lin(group_m=0), r"group_m must be a positive int"),
]


@pytest.mark.parametrize("kwargs,match", BAD_LINEAR)
def test_mx_linear_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tk.mx_linear(**kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    # whatever this process's TRITON_INTERPRET: the wrappers see a machine without the interpreter
    monkeypatch.setattr(triton_checks, "_interpreting", lambda: False)
    p, s = _w()
    for call in (
        lambda: tk.quantize(torch.zeros(2, 64)),
        lambda: tk.dequantize(p, s, 64),
        lambda: tk.mx_linear(torch.zeros(3, 64), p, s, 64),
    ):
        with pytest.raises(ValueError, match=r"need a CUDA device, or TRITON_INTERPRET=1"):
            call()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"bias is on cpu but x is on cuda"):
            tk.mx_linear(torch.zeros(3, 64, device="cuda"), p.cuda(), s.cuda(), 64, bias=torch.zeros(8))
