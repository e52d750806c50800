"""Blockwise, Triton and random-feature kernel sums against dense brute force (small n)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from crucible.ccmmd import (
    GaussianKernel,
    gaussian_kernel_matrix,
    kernel_matvec,
    median_bandwidth,
    rff_matvec,
    weighted_kernel_sum,
    within_kernel_sum,
)


def data(n_x=50, n_y=37, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_x, d, generator=g, dtype=torch.float64) + 3.0  # off-centre on purpose
    y = torch.randn(n_y, d, generator=g, dtype=torch.float64) + 3.4
    w = torch.randn(n_y, 3, generator=g, dtype=torch.float64)
    return x, y, w


@pytest.mark.parametrize("block", [1, 7, 37, 50, 64, 4096])  # some divide 50 or 37, some do not
@pytest.mark.parametrize("bw", [2.5, (1.0, 3.0)])
def test_cross_sums_equal_brute_force(block, bw):
    x, y, w = data()
    ref = gaussian_kernel_matrix(x, y, bw) @ w
    out = kernel_matvec(x, y, w, bw, block_size=block, backend="torch")
    assert out.dtype == torch.float64 and out.shape == (50, 3)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("block", [1, 5, 10, 16, 50, 64])
@pytest.mark.parametrize("bw", [2.5, (1.0, 3.0)])
def test_within_sums_exclude_the_diagonal_exactly(block, bw):
    x, _, _ = data()
    w = torch.linspace(-1, 2, 50, dtype=torch.float64)
    k = gaussian_kernel_matrix(x, x, bw)
    off = k - torch.diag(torch.diag(k))
    sym = kernel_matvec(x, None, w, bw, exclude_diagonal=True, block_size=block)
    torch.testing.assert_close(sym, off @ w, rtol=2e-5, atol=2e-5)
    # The same pairs through the non-symmetric path (x against a copy of itself).
    two = kernel_matvec(x, x.clone(), w, bw, exclude_diagonal=True, block_size=block)
    torch.testing.assert_close(two, off @ w, rtol=2e-5, atol=2e-5)
    # Including the diagonal differs by exactly k(y, y) = number of bandwidths per item.
    full = kernel_matvec(x, None, w, bw, block_size=block)
    nb = 1 if isinstance(bw, float) else len(bw)
    torch.testing.assert_close(full - sym, nb * w, rtol=1e-5, atol=1e-5)


def test_scalar_sum_helpers():
    x, y, w = data()
    a = torch.linspace(0, 1, 50, dtype=torch.float64)
    b = w[:, 0]
    assert weighted_kernel_sum(x, y, a, b, 2.0, block_size=16) == pytest.approx(
        float(a @ gaussian_kernel_matrix(x, y, 2.0) @ b), rel=1e-5
    )
    k = gaussian_kernel_matrix(y, y, 2.0)
    expect = float(b @ k @ b - (b * b).sum())
    assert within_kernel_sum(y, b, 2.0, block_size=8) == pytest.approx(expect, rel=1e-5)


def test_label_product_kernel_equals_masked_dense():
    x, y, w = data()
    lx = torch.arange(50) % 3
    ly = torch.arange(37) % 2
    mask = (lx[:, None] == ly[None, :]).to(torch.float64)
    ref = (gaussian_kernel_matrix(x, y, 2.0) * mask) @ w
    out = kernel_matvec(x, y, w, 2.0, labels_x=lx, labels_y=ly, block_size=9)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    wx = torch.ones(50, dtype=torch.float64)
    kx = gaussian_kernel_matrix(x, x, 2.0) * (lx[:, None] == lx[None, :])
    kx.fill_diagonal_(0)
    torch.testing.assert_close(
        kernel_matvec(x, None, wx, 2.0, labels_x=lx, exclude_diagonal=True), kx @ wx, rtol=2e-5, atol=2e-5
    )


def test_median_bandwidth_is_seeded_and_matches_full_median_on_small_input():
    x, y, _ = data()
    full = torch.pdist(torch.cat([x, y])).median().item()
    assert median_bandwidth(x, y, subsample=1000) == pytest.approx(full)
    a = median_bandwidth(x, y, subsample=40, seed=1)
    assert a == median_bandwidth(x, y, subsample=40, seed=1)
    assert GaussianKernel(scales=(0.5, 2.0)).resolve(x, y) == pytest.approx((full / 2, 2 * full))


def test_bad_features_and_bandwidths_raise():
    x, y, w = data()
    bad = y.clone()
    bad[4, 2] = float("nan")
    with pytest.raises(ValueError, match=r"y: row 4, column 2 is nan; features must be finite"):
        kernel_matvec(x, bad, w, 1.0)
    with pytest.raises(ValueError, match="bandwidths"):
        kernel_matvec(x, y, w, (1.0, -2.0))
    with pytest.raises(ValueError, match="exclude_diagonal"):
        kernel_matvec(x, y, w, 1.0, exclude_diagonal=True)
    with pytest.raises(ValueError, match="w: expected shape"):
        kernel_matvec(x, y, w[:5], 1.0)


def test_rff_error_falls_as_features_grow():
    x, y, w = data(n_x=80, n_y=80, d=4)
    ref = gaussian_kernel_matrix(x, y, 2.0) @ w
    refw = (gaussian_kernel_matrix(y, y, 2.0) - torch.eye(80, dtype=torch.float64)) @ w

    def err(n_features):
        errs = []
        for seed in range(6):
            a = rff_matvec(x, y, w, 2.0, n_features=n_features, seed=seed)
            b = rff_matvec(y, None, w, 2.0, n_features=n_features, seed=seed, exclude_diagonal=True)
            errs.append(((a - ref).norm() / ref.norm() + (b - refw).norm() / refw.norm()).item())
        return sum(errs) / len(errs)

    e = [err(d) for d in (32, 512, 8192)]
    assert e[0] > 2 * e[1] > 4 * e[2]  # ~1/sqrt(D): each step is 16x the features, ~4x less error
    assert rff_matvec(x, y, w, 2.0, n_features=64, seed=3).equal(rff_matvec(x, y, w, 2.0, n_features=64, seed=3))


TRITON_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from crucible.ccmmd import kernel_matvec
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 10, generator=g) + 1.0
    y = torch.randn(45, 10, generator=g)
    w = torch.randn(45, 3, generator=g)
    for bw in (3.0, (1.5, 4.0)):
        a = kernel_matvec(x, y, w, bw, backend="triton")
        b = kernel_matvec(x, y, w, bw, backend="torch")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        a = kernel_matvec(y, y, w, bw, backend="triton", exclude_diagonal=True)
        b = kernel_matvec(y, None, w, bw, backend="torch", exclude_diagonal=True)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert a.dtype == torch.float64 and a.shape == (45, 3)
    # every precision and tile shape computes the same sums (the interpreter's dots are float32;
    # "tf32" within TF32's rounding where it is emulated)
    from crucible.ccmmd import triton_kernels as tk
    from crucible.ccmmd.kernels import augment_pair
    xa, ya = augment_pair(x, y)
    want = kernel_matvec(x, y, w, (1.5, 4.0), backend="torch")
    gam = [1 / (2 * 1.5**2), 1 / (2 * 4.0**2)]
    for prec, tol in (("tf32x3", 1e-5), ("ieee", 1e-5), ("tf32", 3e-3)):
        for blocks in (dict(block_m=16, block_n=32, block_d=16), dict(block_m=128, block_n=16, block_d=64)):
            got = tk.triton_matvec(xa, ya, w, gam, False, precision=prec, num_warps=8, **blocks)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # a device where tf32x3 does not build: the default warns once and runs ieee; asked-for tf32x3 raises
    import warnings
    from triton.runtime.errors import OutOfResources
    real = tk._KERNEL
    class NoTf32x3:
        def __getitem__(self, grid):
            def launch(*args, PREC, **kw):
                if PREC == "tf32x3":
                    raise OutOfResources(1, 0, "tf32x3 on this device")
                return real[grid](*args, PREC=PREC, **kw)
            return launch
    tk._KERNEL = NoTf32x3()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.testing.assert_close(tk.triton_matvec(xa, ya, w, gam, False), want, rtol=1e-5, atol=1e-5)
    assert sum("did not build" in str(m.message) for m in seen) == 1, [str(m.message) for m in seen]
    try:
        tk.triton_matvec(xa, ya, w, gam, False, precision="tf32x3")
        raise AssertionError("an asked-for precision must not fall back")
    except OutOfResources:
        pass
    tk._KERNEL = real
    print("TRITON_OK")
""")


def test_triton_interpreter_equals_torch():
    pytest.importorskip("triton")
    # TRITON_INTERPRET must be set before triton is first imported, so run in a fresh process.
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "TRITON_OK" in res.stdout, res.stderr[-3000:]


def test_triton_matvec_rejects_bad_options():
    pytest.importorskip("triton")
    from crucible.ccmmd import triton_kernels as tk

    z = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"precision: 'fp16'; valid values are \('tf32x3', 'tf32', 'ieee'\)"):
        tk.triton_matvec(z, z, torch.zeros(4, 1), [1.0], False, precision="fp16")
    with pytest.raises(ValueError, match=r"block_n: 48; valid values are powers of two >= 16"):
        tk.triton_matvec(z, z, torch.zeros(4, 1), [1.0], False, block_n=48)
