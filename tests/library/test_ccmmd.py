"""CC-MMD estimator: identities, dense brute force, delta-method gradient, coverage, bad inputs."""

import json

import numpy as np
import pytest
import torch

from crucible.ccmmd import GaussianKernel, cc_mmd, gaussian_kernel_matrix, mmd_terms

KERNEL = GaussianKernel(bandwidths=(2.0,))


def pool(seed=0, n=300, m=150, d=3, eps=0.3):
    rng = np.random.default_rng(seed)
    member = (rng.random(n) >= eps).astype(float)
    y = rng.standard_normal((n, d)) + 0.8 * (1 - member)[:, None] + 0.2
    x = rng.standard_normal((m, d))
    s = 1 / (1 + np.exp(-(1.5 * (2 * member - 1) + rng.standard_normal(n))))
    return x, y, member, s


def audit(n, p, seed):
    rng = np.random.default_rng(seed)
    pi = np.full(n, p)
    return (rng.random(n) < pi).astype(float), pi


def dense_v(x, y, w, bw):
    """V(w) from full float64 kernel matrices, straight from the formulas of docs/methods.md (curate)."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    w = torch.as_tensor(w, dtype=torch.float64)
    kxx, kxy, kyy = (gaussian_kernel_matrix(a, b, bw) for a, b in ((x, x), (x, y), (y, y)))
    m = x.shape[0]
    a = (kxx.sum() - kxx.diag().sum()) / (m * (m - 1))
    b = (kxy * w[None, :]).sum()
    c = w @ kyy @ w - (w * w * kyy.diag()).sum()
    n_w = w.sum()
    return a - 2 * b / (m * n_w) + c / (n_w**2 - (w * w).sum())


def test_full_audit_equals_oracle_exactly():
    x, y, member, s = pool(n=120, m=60)
    res = cc_mmd(x, y, s, np.ones(120), member, np.ones(120), truth=member, kernel=KERNEL)
    assert res.value == res.oracle  # same weights, same sums: bit-identical
    assert res.se == 0.0 and res.ci_low == res.ci_high == res.value
    assert res.eps_hat == pytest.approx(1 - member.mean())


@pytest.mark.parametrize("seed", [1, 2])
def test_scores_equal_truth_give_the_oracle_for_any_audit(seed):
    x, y, member, _ = pool(n=120, m=60)
    i, pi = audit(120, 0.2, seed)
    res = cc_mmd(x, y, member, i, member, pi, truth=member, kernel=KERNEL)
    assert res.value == res.oracle and res.se == 0.0
    assert torch.equal(res.weights, torch.as_tensor(member))


def test_all_four_estimators_match_dense_brute_force():
    x, y, member, s = pool(n=90, m=40, d=4)
    i, pi = audit(90, 0.5, 7)
    bw = (1.0, 3.0)
    res = cc_mmd(x, y, s, i, member, pi, truth=member, kernel=GaussianKernel(bandwidths=bw), block_size=16)
    m = s + i / pi * (member - s)
    for got, w in ((res.value, m), (res.naive, np.ones(90)), (res.audit_only, i * member / pi), (res.oracle, member)):
        assert got == pytest.approx(float(dense_v(x, y, w, bw)), rel=1e-4, abs=1e-6)
    assert res.n_audited == int(i.sum()) and res.n_audited_members == int((i * member).sum())
    assert res.ess == pytest.approx(m.sum() ** 2 / (m**2).sum())


def test_closed_form_gradient_equals_autograd():
    x, y, member, s = pool(n=40, m=30)
    i, pi = audit(40, 0.5, 3)
    w = torch.as_tensor(s + i / pi * (member - s)).requires_grad_(True)
    v = dense_v(x, y, w, 2.0)
    (auto,) = torch.autograd.grad(v, w)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    kxx = gaussian_kernel_matrix(xt, xt, 2.0)
    a = float((kxx.sum() - kxx.diag().sum()) / (30 * 29))
    r = gaussian_kernel_matrix(yt, xt, 2.0).sum(1)
    koff = gaussian_kernel_matrix(yt, yt, 2.0) - torch.eye(40, dtype=torch.float64)
    value, grad = mmd_terms(a, r, koff @ w.detach(), w.detach(), 30)
    assert value == pytest.approx(float(v.detach()), rel=1e-12)
    torch.testing.assert_close(grad, auto, rtol=1e-9, atol=1e-12)


def test_interval_coverage_over_repeated_audits():
    x, y, member, s = pool(seed=0)
    pi = np.full(len(member), 0.4)
    rng = np.random.default_rng(100)
    hits = 0
    for _ in range(200):
        i = (rng.random(len(member)) < pi).astype(float)
        res = cc_mmd(x, y, s, i, member, pi, truth=member, kernel=KERNEL)
        hits += res.ci_low <= res.oracle <= res.ci_high
    assert 0.90 <= hits / 200 <= 0.99


def test_ccmmd_beats_naive_on_contaminated_pool():
    x, y, member, s = pool(seed=0)
    i, pi = audit(len(member), 0.4, 5)
    res = cc_mmd(x, y, s, i, member, pi, truth=member, kernel=KERNEL)
    assert abs(res.value - res.oracle) < 0.25 * abs(res.naive - res.oracle)


def test_rff_method_tracks_exact():
    x, y, member, s = pool(n=200, m=100)
    i, pi = audit(200, 0.4, 1)
    ex = cc_mmd(x, y, s, i, member, pi, kernel=KERNEL)
    rf = cc_mmd(x, y, s, i, member, pi, kernel=KERNEL, method="rff", n_features=8192, seed=0)
    assert rf.value == pytest.approx(ex.value, abs=3e-3)
    assert rf.naive == pytest.approx(ex.naive, abs=3e-3)


def test_supervised_product_kernel_runs_and_matches_dense():
    x, y, member, s = pool(n=60, m=40)
    lx, ly = np.arange(40) % 2, np.arange(60) % 2
    res = cc_mmd(
        x, y, s, np.ones(60), member, np.ones(60), kernel=KERNEL, labels_reference=lx, labels_pool=ly, block_size=8
    )
    xt, yt, w = torch.as_tensor(x), torch.as_tensor(y), torch.as_tensor(member)
    same = lambda a, b: torch.as_tensor(a[:, None] == b[None, :], dtype=torch.float64)  # noqa: E731
    kxx = gaussian_kernel_matrix(xt, xt, 2.0) * same(lx, lx)
    kxy = gaussian_kernel_matrix(xt, yt, 2.0) * same(lx, ly)
    kyy = gaussian_kernel_matrix(yt, yt, 2.0) * same(ly, ly)
    expect = (
        (kxx.sum() - 40) / (40 * 39)
        - 2 * (kxy @ w).sum() / (40 * w.sum())
        + (w @ kyy @ w - w @ w) / (w.sum() ** 2 - w @ w)
    )
    assert res.value == pytest.approx(float(expect), rel=1e-4)


def test_to_dict_is_json_ready():
    x, y, member, s = pool(n=60, m=30)
    i, pi = audit(60, 0.5, 0)
    d = cc_mmd(x, y, s, i, member, pi).to_dict()
    assert "weights" not in d and d["oracle"] is None
    assert json.loads(json.dumps(d))["value"] == d["value"]


def good(n=40, m=20):
    x, y, member, s = pool(n=n, m=m)
    i, pi = audit(n, 0.5, 0)
    return dict(reference=x, pool=y, scores=s, audited=i, member=np.where(i == 1, member, np.nan), pi=pi, kernel=KERNEL)


def with_(key, idx, value):
    args = good()
    a = np.array(args[key], dtype=float, copy=True)
    a[idx] = value
    args[key] = a
    return args


@pytest.mark.parametrize(
    "args, fragment",
    [
        (with_("reference", (3, 1), np.nan), "reference: row 3, column 1 is nan"),
        (with_("pool", (5, 0), np.inf), "pool: row 5, column 0 is inf"),
        (with_("scores", 7, 1.5), "scores: index 7 is 1.5; valid values are scores in [0, 1]"),
        (with_("pi", 2, 0.0), "pi: index 2 is 0.0; valid values are inclusion probabilities in (0, 1]"),
        (with_("pi", 2, 1.01), "pi: index 2 is 1.01"),
    ],
)
def test_bad_inputs_raise_with_argument_index_and_value(args, fragment):
    with pytest.raises(ValueError) as err:
        cc_mmd(**args)
    assert fragment in str(err.value)


def test_member_not_binary_on_the_audit_raises():
    args = good()
    j = int(np.flatnonzero(args["audited"])[0])
    args["member"] = args["member"].copy()
    args["member"][j] = 0.5
    with pytest.raises(ValueError, match=f"member: index {j} is 0.5; valid values are 0 or 1"):
        cc_mmd(**args)


def test_audit_without_members_raises():
    args = good()
    args["member"] = np.zeros(40)
    with pytest.raises(ValueError, match="found no members"):
        cc_mmd(**args)


def test_fewer_than_two_clean_items_raises():
    args = good()
    n = 40
    args.update(
        scores=np.zeros(n), audited=np.ones(n), pi=np.ones(n), member=np.eye(1, n, 3)[0]
    )  # exactly one member, fully audited: N_hat = 1
    with pytest.raises(ValueError, match="at least two estimated clean items"):
        cc_mmd(**args)


def test_shape_mismatches_raise():
    args = good()
    args["pool"] = args["pool"][:, :2]
    with pytest.raises(ValueError, match="pool: expected 3 features per item, got 2"):
        cc_mmd(**args)
    args = good()
    args["scores"] = args["scores"][:-1]
    with pytest.raises(ValueError, match="scores: expected length 40"):
        cc_mmd(**args)
