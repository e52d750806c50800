"""crucible.quant.lowrank and .rank_allocation: closed forms (Eckart-Young, hand-computed scales) and brute force."""

import itertools
import math

import numpy as np
import pytest
import torch

from crucible.quant.lowrank import (
    SCALE_FLOOR,
    ErrorSVD,
    InputStats,
    activation_scale,
    compensate,
    error_spectrum,
    factorize,
)
from crucible.quant.mxfp4 import dequantize, quantize
from crucible.quant.rank_allocation import allocate_ranks, uniform_ranks, weighted_error

# --------------------------------------------------------------------------- helpers


def _random_case(rng, n_max=4, len_max=5):
    n = int(rng.integers(1, n_max + 1))
    spectra, loads = [], []
    for _ in range(n):
        m = int(rng.integers(1, len_max + 1))
        vals = rng.exponential(size=m)
        if rng.random() < 0.3:  # ties and zeros
            vals = np.round(vals * 2) / 2
        spectra.append(np.sort(vals)[::-1].copy())
        loads.append(0.0 if rng.random() < 0.2 else float(rng.choice([1.0, 2.0, rng.exponential()])))
    return spectra, loads


def _brute_force(spectra, loads, budget):
    best = math.inf
    for r in itertools.product(*[range(len(a) + 1) for a in spectra]):
        if sum(r) == budget:
            best = min(best, weighted_error(spectra, loads, list(r)))
    return best


def _greedy_reference(spectra, loads, budget):
    """The one-unit-at-a-time greedy, literally: largest next gain, lowest index on ties."""
    ranks = [0] * len(spectra)
    for _ in range(budget):
        best, best_i = -1.0, None
        for i, (a, w) in enumerate(zip(spectra, loads)):
            if ranks[i] < len(a):
                g = w * a[ranks[i]] ** 2
                if g > best:
                    best, best_i = g, i
        ranks[best_i] += 1
    return ranks


def _round_robin(lengths, budget):
    ranks = [0] * len(lengths)
    for _ in range(budget):
        i = min((r, i) for i, (r, m) in enumerate(zip(ranks, lengths)) if r < m)[1]
        ranks[i] += 1
    return ranks


def _orthogonal_design(n, scales, seed):
    """X (n, K) with X^T X = n diag(scales^2) exactly: the diagonal approximation is exact."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, scales.numel(), generator=g, dtype=torch.float64))
    return math.sqrt(n) * q * scales[None, :]


# --------------------------------------------------------------------------- allocate_ranks


def test_allocate_matches_brute_force_optimum():
    rng = np.random.default_rng(0)
    n_cases = 0
    for _ in range(150):
        spectra, loads = _random_case(rng)
        total = sum(len(a) for a in spectra)
        for budget in range(total + 1):
            ranks = allocate_ranks(spectra, loads, budget)
            assert sum(ranks) == budget
            assert all(0 <= r <= len(a) for r, a in zip(ranks, spectra))
            got = weighted_error(spectra, loads, ranks)
            best = _brute_force(spectra, loads, budget)
            assert got == pytest.approx(best, rel=1e-12, abs=1e-12), (spectra, loads, budget, ranks)
            n_cases += 1
    assert n_cases > 500


def test_allocate_equals_literal_greedy_including_ties():
    rng = np.random.default_rng(1)
    for _ in range(100):
        spectra, loads = _random_case(rng, n_max=6, len_max=8)
        total = sum(len(a) for a in spectra)
        for budget in range(total + 1):
            assert allocate_ranks(spectra, loads, budget) == _greedy_reference(spectra, loads, budget)
    # a larger case, where the sort over all gains replaces thousands of greedy steps
    spectra = [np.sort(rng.exponential(size=int(rng.integers(1, 60))))[::-1] for _ in range(40)]
    loads = rng.exponential(size=40)
    budget = sum(len(a) for a in spectra) // 2
    assert allocate_ranks(spectra, loads, budget) == _greedy_reference(spectra, loads, budget)


def test_each_unit_strictly_lowers_error_while_gain_positive():
    rng = np.random.default_rng(2)
    checked = 0
    for _ in range(60):
        spectra, loads = _random_case(rng, n_max=5, len_max=7)
        total = sum(len(a) for a in spectra)
        prev = allocate_ranks(spectra, loads, 0)
        for budget in range(total):
            nxt = allocate_ranks(spectra, loads, budget + 1)
            # nested: one more unit on top of the previous allocation
            assert all(b >= a for a, b in zip(prev, nxt)) and sum(nxt) == sum(prev) + 1
            gain = max(w * a[r] ** 2 for a, w, r in zip(spectra, loads, prev) if r < len(a))
            e0 = weighted_error(spectra, loads, prev)
            e1 = weighted_error(spectra, loads, nxt)
            if gain > 0:
                assert e1 < e0
                assert e0 - e1 == pytest.approx(gain, rel=1e-9)
                checked += 1
            else:
                assert e1 == pytest.approx(e0)
            prev = nxt
    assert checked > 100


def test_load_aware_favours_the_loaded_matrix():
    sp = [4.0, 3.0, 2.0, 1.0]
    for budget in range(1, 8):
        r = allocate_ranks([sp, sp], [1.0, 3.0], budget)
        assert r[1] >= r[0]
    assert allocate_ranks([sp, sp], [1.0, 3.0], 4)[1] > allocate_ranks([sp, sp], [1.0, 3.0], 4)[0]
    assert allocate_ranks([sp, sp], [1.0, 3.0], 4) == [1, 3]  # gains 16,9,4,1 vs 48,27,12,3
    # zero load: never gets a unit while the other has positive gain
    assert allocate_ranks([sp, sp], [0.0, 1.0], 4) == [0, 4]


def test_equal_loads_equal_spectra_match_uniform():
    sp = torch.tensor([5.0, 3.0, 2.5, 1.0, 0.5])
    for n in (2, 3, 4):
        for budget in range(n * 5 + 1):
            assert allocate_ranks([sp] * n, [2.0] * n, budget) == uniform_ranks([5] * n, budget)


def test_accepts_tensors_arrays_and_lists():
    sp = [torch.tensor([3.0, 1.0]), np.array([2.0, 2.0, 0.0]), [1.5]]
    assert (
        allocate_ranks(sp, torch.tensor([1.0, 1.0, 1.0]), 3)
        == allocate_ranks([[3.0, 1.0], [2.0, 2.0, 0.0], [1.5]], [1, 1, 1], 3)
        == [1, 2, 0]
    )


# --------------------------------------------------------------------------- uniform_ranks


def test_uniform_ranks_closed_forms():
    assert uniform_ranks([1, 5, 5, 2], 9) == [1, 3, 3, 2]
    assert uniform_ranks([1, 5, 5, 2], 8) == [1, 3, 2, 2]
    assert uniform_ranks([1, 5, 5, 2], 13) == [1, 5, 5, 2]
    assert uniform_ranks([3, 3, 3], 0) == [0, 0, 0]
    assert uniform_ranks([], 0) == []


def test_uniform_ranks_sum_cap_evenness():
    rng = np.random.default_rng(3)
    for _ in range(200):
        lengths = [int(v) for v in rng.integers(0, 9, size=int(rng.integers(1, 7)))]
        for budget in range(sum(lengths) + 1):
            r = uniform_ranks(lengths, budget)
            assert sum(r) == budget
            assert all(0 <= a <= m for a, m in zip(r, lengths))
            # as even as possible: a matrix below its cap is at most one unit below any other
            for i in range(len(r)):
                if r[i] < lengths[i]:
                    assert all(r[j] <= r[i] + 1 for j in range(len(r)))
            assert r == _round_robin(lengths, budget)


# --------------------------------------------------------------------------- validation


def test_allocation_validation_names_the_problem():
    sp = [[3.0, 2.0], [1.0, 0.5, 0.1]]
    with pytest.raises(ValueError, match=r"budget 6 exceeds the total available rank 5"):
        allocate_ranks(sp, [1, 1], 6)
    with pytest.raises(ValueError, match=r"budget 6 exceeds the total available rank 5"):
        uniform_ranks([2, 3], 6)
    with pytest.raises(ValueError, match=r"budget must be >= 0, got -1"):
        allocate_ranks(sp, [1, 1], -1)
    with pytest.raises(ValueError, match=r"spectra\[1\] must be non-increasing.*spectra\[1\]\[1\] = 0\.5"):
        allocate_ranks([[3.0, 2.0], [1.0, 0.5, 0.7]], [1, 1], 2)
    with pytest.raises(ValueError, match=r"spectra\[0\] must be >= 0.*-1\.0"):
        allocate_ranks([[-1.0], [1.0]], [1, 1], 1)
    with pytest.raises(ValueError, match=r"spectra\[1\] must be finite.*nan"):
        allocate_ranks([[1.0], [float("nan")]], [1, 1], 1)
    with pytest.raises(ValueError, match=r"loads\[1\] must be >= 0, got -0\.5"):
        allocate_ranks(sp, [1.0, -0.5], 1)
    with pytest.raises(ValueError, match=r"loads\[0\] must be finite, got nan"):
        allocate_ranks(sp, [float("nan"), 1.0], 1)
    with pytest.raises(ValueError, match=r"loads has 1 entries for 2 spectra"):
        allocate_ranks(sp, [1.0], 1)
    with pytest.raises(ValueError, match=r"ranks\[1\] = 4 exceeds len\(spectra\[1\]\) = 3"):
        weighted_error(sp, [1, 1], [0, 4])
    with pytest.raises(ValueError, match=r"budget must be an int"):
        allocate_ranks(sp, [1, 1], 1.5)


def test_weighted_error_closed_form():
    sp = [[3.0, 2.0, 1.0], [4.0]]
    assert weighted_error(sp, [2.0, 0.5], [1, 0]) == pytest.approx(2.0 * (4 + 1) + 0.5 * 16)
    assert weighted_error(sp, [2.0, 0.5], [3, 1]) == 0.0


# --------------------------------------------------------------------------- activation scales


def test_activation_scale_hand_computed():
    x = torch.tensor([[1.0, -2.0, 4.0], [3.0, 2.0, -4.0]])
    # sum|x| = [4, 4, 8], sum x^2 = [10, 8, 32], count 2
    stats = InputStats().update(x[:1].reshape(1, 1, 3)).update(x[1:])
    assert stats.count == 2
    torch.testing.assert_close(stats.sum_abs, torch.tensor([4.0, 4.0, 8.0], dtype=torch.float64))
    torch.testing.assert_close(stats.sum_sq, torch.tensor([10.0, 8.0, 32.0], dtype=torch.float64))
    qera = torch.tensor([math.sqrt(5.0), 2.0, 4.0], dtype=torch.float64)
    # mean|x| = [2, 2, 4], sqrt(min * max) = sqrt(8)
    lqer = torch.tensor([1 / math.sqrt(2), 1 / math.sqrt(2), math.sqrt(2)], dtype=torch.float64)
    torch.testing.assert_close(stats.scale("qera"), qera)
    torch.testing.assert_close(stats.scale("lqer"), lqer)
    torch.testing.assert_close(activation_scale([4, 4, 8], [10, 8, 32], 2, "qera"), qera)
    torch.testing.assert_close(activation_scale([4, 4, 8], [10, 8, 32], 2, "lqer"), lqer)
    torch.testing.assert_close(stats.scale("plain"), torch.ones(3, dtype=torch.float64))


def test_dead_features_are_floored_and_finite():
    x = torch.tensor([[2.0, 0.0, 1e-30], [-2.0, 0.0, 0.0]])
    stats = InputStats().update(x)
    s = stats.scale("qera")
    assert torch.all(s > 0) and torch.all(torch.isfinite(1 / s))
    torch.testing.assert_close(s, torch.tensor([2.0, 2.0 * SCALE_FLOOR, 2.0 * SCALE_FLOOR], dtype=torch.float64))
    s = stats.scale("lqer")  # mean|x| = [2, 0, 5e-31] -> floored [2, 2e-6, 2e-6] / sqrt(2e-6 * 2)
    torch.testing.assert_close(s, torch.tensor([1e3, 1e-3, 1e-3], dtype=torch.float64))
    # every feature dead: plain
    torch.testing.assert_close(InputStats().update(torch.zeros(4, 3)).scale("lqer"), torch.ones(3, dtype=torch.float64))
    # the floored scale still gives finite factors that reconstruct E
    E = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    A, B = compensate(E, 3, stats.scale("qera"))
    assert torch.isfinite(A).all() and torch.isfinite(B).all()
    torch.testing.assert_close(A @ B, E, atol=1e-4, rtol=1e-4)


def test_scale_validation():
    with pytest.raises(ValueError, match=r"2 NaN and 1 inf"):
        InputStats().update(torch.tensor([[float("nan"), 1.0], [float("nan"), float("inf")]]))
    stats = InputStats().update(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"last dimension 4 differs from earlier batches' 3"):
        stats.update(torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"no calibration rows"):
        InputStats().scale()
    with pytest.raises(ValueError, match=r"kind must be one of"):
        stats.scale("awq")
    with pytest.raises(ValueError, match=r"sum_sq holds 1 NaN"):
        activation_scale([1.0, 1.0], [1.0, float("nan")], 2)
    with pytest.raises(ValueError, match=r"count must be a positive int"):
        activation_scale([1.0], [1.0], 0)
    with pytest.raises(ValueError, match=r"sum_abs must be >= 0, got sum_abs\[1\] = -1"):
        activation_scale([1.0, -1.0], [1.0, 1.0], 2, "lqer")


# --------------------------------------------------------------------------- compensate


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_full_rank_reconstructs_exactly(shape):
    g = torch.Generator().manual_seed(4)
    E = torch.randn(*shape, generator=g)
    s = torch.logspace(-2, 2, shape[1], dtype=torch.float64)[torch.randperm(shape[1], generator=g)]
    m = min(shape)
    for scale in (None, s):
        A, B = compensate(E, m, scale)
        assert A.dtype == B.dtype == torch.float32 and A.shape == (shape[0], m) and B.shape == (m, shape[1])
        torch.testing.assert_close(A @ B, E, atol=1e-5, rtol=1e-5)
    A, B = compensate(E, 0, s)
    assert A.shape == (shape[0], 0) and B.shape == (0, shape[1]) and A.dtype == torch.float32
    with pytest.raises(ValueError, match=rf"rank must be in \[0, min\(N, K\)\] = \[0, {m}\].*got {m + 1}"):
        compensate(E, m + 1)
    with pytest.raises(ValueError, match=r"got -1"):
        compensate(E, -1, s)


def test_eckart_young_residual():
    g = torch.Generator().manual_seed(5)
    E = torch.randn(30, 50, generator=g, dtype=torch.float64)
    s = torch.rand(50, generator=g, dtype=torch.float64) * 3 + 0.1
    sig = torch.linalg.svdvals(E)
    sig_s = torch.linalg.svdvals(E * s)
    torch.testing.assert_close(error_spectrum(E), sig)
    torch.testing.assert_close(error_spectrum(E, s), sig_s)
    for r in (0, 1, 5, 17, 29):
        A, B = compensate(E, r)
        res = ((E - A.double() @ B.double()) ** 2).sum()
        assert float(res) == pytest.approx(float((sig[r:] ** 2).sum()), rel=1e-5)
        A, B = compensate(E, r, s)
        res = (((E - A.double() @ B.double()) * s) ** 2).sum()
        assert float(res) == pytest.approx(float((sig_s[r:] ** 2).sum()), rel=1e-5)


def test_scaled_beats_plain_on_activation_weighted_error():
    g = torch.Generator().manual_seed(6)
    n_out, k, rank = 32, 64, 8
    E = torch.randn(n_out, k, generator=g, dtype=torch.float64)
    c = torch.logspace(-2, 2, k, dtype=torch.float64)[torch.randperm(k, generator=g)]
    X = _orthogonal_design(512, c, seed=7)
    stats = InputStats()
    for batch in X.split(100):
        stats.update(batch)
    s = stats.scale("qera")
    torch.testing.assert_close(s, c)
    Ap, Bp = compensate(E, rank)
    As, Bs = compensate(E, rank, s)
    Rp, Rs = E - Ap.double() @ Bp.double(), E - As.double() @ Bs.double()
    act_plain, act_scaled = torch.linalg.norm(X @ Rp.T), torch.linalg.norm(X @ Rs.T)
    assert act_scaled < 0.5 * act_plain
    assert torch.linalg.norm(Rp) < 0.95 * torch.linalg.norm(Rs)
    # LQER's scale (a different diagonal) also beats plain here
    Al, Bl = compensate(E, rank, stats.scale("lqer"))
    assert torch.linalg.norm(X @ (E - Al.double() @ Bl.double()).T) < 0.5 * act_plain


def test_global_scale_of_s_does_not_change_the_adapter():
    g = torch.Generator().manual_seed(8)
    E = torch.randn(16, 32, generator=g)
    s = torch.rand(32, generator=g, dtype=torch.float64) + 0.5
    A1, B1 = compensate(E, 6, s)
    A2, B2 = compensate(E, 6, 1000.0 * s)
    torch.testing.assert_close(A1 @ B1, A2 @ B2, atol=1e-5, rtol=1e-5)


def test_factorize_reuse_and_validation():
    g = torch.Generator().manual_seed(9)
    E = torch.randn(20, 12, generator=g)
    s = torch.rand(12, generator=g, dtype=torch.float64) + 0.1
    svd = factorize(E, s)
    assert isinstance(svd, ErrorSVD) and svd.max_rank == 12
    torch.testing.assert_close(error_spectrum(svd), error_spectrum(E, s))
    sp = error_spectrum(svd)
    assert sp.dtype == torch.float64 and torch.all(sp[1:] <= sp[:-1])
    for r in (0, 3, 12):
        for a, b in zip(compensate(svd, r), compensate(E, r, s)):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"already holds its scale"):
        compensate(svd, 2, s)
    with pytest.raises(ValueError, match=r"E holds 1 NaN"):
        factorize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"s must be > 0.*s\[1\] = 0"):
        factorize(E, torch.tensor([1.0, 0.0] + [1.0] * 10))
    with pytest.raises(ValueError, match=r"s must have shape \(12,\)"):
        factorize(E, torch.ones(5))
    with pytest.raises(ValueError, match=r"2-D"):
        factorize(torch.ones(3))


@pytest.mark.parametrize("shape", [(20, 12), (12, 20)])
def test_gram_eigh_fallback_when_lapack_fails(monkeypatch, shape):
    g = torch.Generator().manual_seed(10)
    # rank-deficient (rank 7) so zero singular values take the fallback's guarded branch
    E = torch.randn(shape[0], 7, generator=g) @ torch.randn(7, shape[1], generator=g)
    s = torch.rand(shape[1], generator=g, dtype=torch.float64) + 0.2
    ref = factorize(E, s)
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", fail)
    fb = factorize(E, s)
    assert calls
    torch.testing.assert_close(fb.S, ref.S, atol=1e-6, rtol=1e-9)
    assert torch.all(fb.S[1:] <= fb.S[:-1]) and torch.isfinite(fb.U).all() and torch.isfinite(fb.Vh).all()
    for r in (3, 7, 12):
        A, B = compensate(fb, r)
        A0, B0 = compensate(ref, r)
        torch.testing.assert_close(A @ B, A0 @ B0, atol=1e-4, rtol=1e-4)
    A, B = compensate(fb, 12)
    torch.testing.assert_close(A @ B, E, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- real use: MXFP4 errors


def test_mxfp4_error_compensation_monotone_and_exact_at_full_rank():
    g = torch.Generator().manual_seed(11)
    W = torch.randn(64, 128, generator=g) * 0.05
    E = W - dequantize(quantize(W))
    assert float(E.abs().max()) > 0
    x_scale = torch.logspace(-1, 1, 128, dtype=torch.float64)
    for s in (None, x_scale):
        svd = factorize(E, s)
        w = torch.ones(128, dtype=torch.float64) if s is None else s
        errs = []
        for r in range(0, 65):
            A, B = compensate(svd, r)
            errs.append(float(torch.linalg.norm((E.double() - A.double() @ B.double()) * w)))
        e0 = float(torch.linalg.norm(E.double() * w))
        assert errs[0] == pytest.approx(e0)
        assert all(b <= a + 1e-6 * e0 for a, b in zip(errs, errs[1:]))
        assert errs[32] < 0.9 * e0
        assert errs[64] < 1e-5 * e0
        # the spectrum predicts the residual: ||(E - A_r B_r) diag(s)||^2 = sum_{j > r} sigma_j^2
        sp = error_spectrum(svd)
        for r in (0, 10, 40):
            assert errs[r] ** 2 == pytest.approx(float((sp[r:] ** 2).sum()), rel=1e-4)


def test_mxfp4_experts_load_aware_allocation():
    g = torch.Generator().manual_seed(12)
    # four "experts" of one layer, different weight scales (so different error spectra) and loads
    experts = [torch.randn(32, 64, generator=g) * a for a in (0.02, 0.05, 0.05, 0.1)]
    loads = [0.4, 0.1, 0.3, 0.2]
    svds = [factorize(W - dequantize(quantize(W))) for W in experts]
    spectra = [error_spectrum(v) for v in svds]
    budget = 48
    ranks = allocate_ranks(spectra, loads, budget)
    uni = uniform_ranks([len(sp) for sp in spectra], budget)
    assert sum(ranks) == budget
    actual = 0.0
    for svd, load, r in zip(svds, loads, ranks):
        A, B = compensate(svd, r)
        E = svd.U @ torch.diag(svd.S) @ svd.Vh
        actual += load * float(((E - A.double() @ B.double()) ** 2).sum())
    assert actual == pytest.approx(weighted_error(spectra, loads, ranks), rel=1e-4)
    assert weighted_error(spectra, loads, ranks) < weighted_error(spectra, loads, uni)
