"""Survey-design estimators (crucible.design) against exact enumeration of all audit outcomes."""

import itertools

import numpy as np
import pytest
import torch

from crucible.design import corrected_membership, difference_estimate, linear_design_variance, ratio_estimate

S = np.array([0.9, 0.2, 0.6, 0.1, 0.75, 0.4])
M = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
PI = np.array([0.5, 0.3, 1.0, 0.25, 0.6, 0.8])


def all_audits(pi):
    """Every audit outcome I in {0,1}^n with its Poisson-design probability."""
    for bits in itertools.product([0.0, 1.0], repeat=len(pi)):
        i = np.array(bits)
        yield i, float(np.prod(np.where(i == 1, pi, 1 - pi)))


def test_corrected_membership_formula_by_hand():
    m = corrected_membership([0.3, 0.3, 0.8], [1, 0, 1], [1, 7, 0], [0.5, 0.5, 0.25])
    # audited member: 0.3 + 2 * 0.7; unaudited: the score; audited non-member: 0.8 - 4 * 0.8
    assert torch.allclose(m, torch.tensor([1.7, 0.3, -2.4], dtype=torch.float64))


def test_first_and_second_moments_by_exact_enumeration():
    e1 = np.zeros(len(S))
    e2 = np.zeros((len(S), len(S)))
    total = 0.0
    for i, prob in all_audits(PI):
        m = corrected_membership(S, i, M, PI).numpy()
        e1 += prob * m
        e2 += prob * np.outer(m, m)
        total += prob
    assert total == pytest.approx(1.0)
    np.testing.assert_allclose(e1, M, atol=1e-12)
    off = ~np.eye(len(S), dtype=bool)
    np.testing.assert_allclose(e2[off], np.outer(M, M)[off], atol=1e-12)
    # The diagonal is biased (E m_j^2 > M_j^2 where pi_j < 1): why the U-statistic drops j = l.
    assert np.all(np.diag(e2)[PI < 1] > M[PI < 1] ** 2 + 1e-6)


def test_variance_estimator_is_unbiased_for_the_design_variance():
    g = np.array([0.5, -1.0, 2.0, 0.3, 1.5, -0.7])
    mean = var_hat = second = 0.0
    for i, prob in all_audits(PI):
        stat = float(g @ corrected_membership(S, i, M, PI).numpy())
        mean += prob * stat
        second += prob * stat**2
        var_hat += prob * linear_design_variance(g, S, i, M, PI)
    assert var_hat == pytest.approx(second - mean**2, rel=1e-10)


def test_difference_estimate_general_proxy_and_total():
    proxy = np.array([2.0, -1.0, 5.0])
    est = difference_estimate(proxy, [1, 0, 1], [3.0, np.nan, 4.0], [0.5, 0.5, 1.0])
    np.testing.assert_allclose(est.values.numpy(), [4.0, -1.0, 4.0])
    assert est.total == pytest.approx(7.0)


def test_ratio_estimate_exact_under_full_audit():
    y = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    r = ratio_estimate(S * y, M * y, S, M, np.ones(6), np.ones(6))
    assert r.value == pytest.approx((M * y).sum() / M.sum())
    assert r.se == 0.0 and r.ci_low == r.ci_high == r.value


def test_ratio_estimate_interval_covers_the_truth():
    rng = np.random.default_rng(3)
    n = 400
    member = (rng.random(n) < 0.7).astype(float)
    y = rng.standard_normal(n) + 2 * member
    s = np.clip(member * 0.6 + rng.random(n) * 0.4, 0, 1)
    truth = (member * y).sum() / member.sum()
    pi = np.full(n, 0.3)
    hits = 0
    for _ in range(200):
        i = (rng.random(n) < pi).astype(float)
        r = ratio_estimate(s * y, member * y, s, member, i, pi)
        hits += r.ci_low <= truth <= r.ci_high
    assert 0.88 <= hits / 200 <= 0.99


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"scores": [0.5, 1.2, 0.1]}, "scores: index 1 is 1.2"),
        ({"scores": [0.5, -0.1, 0.1]}, "scores: index 1 is -0.1"),
        ({"scores": [0.5, np.nan, 0.1]}, "scores: index 1 is nan"),
        ({"pi": [0.5, 0.0, 0.5]}, "pi: index 1 is 0.0; valid values are inclusion probabilities in (0, 1]"),
        ({"pi": [0.5, 0.5, 1.5]}, "pi: index 2 is 1.5"),
        ({"member": [1, 0, 2]}, "member: index 2 is 2.0; valid values are 0 or 1 where audited"),
        ({"member": [1, 0, np.nan]}, "member: index 2 is nan"),
        ({"audited": [1, 0.5, 1]}, "audited: index 1 is 0.5"),
        ({"audited": [1, 0]}, "audited: expected length 3"),
        ({"scores": [[0.5, 0.5, 0.5]]}, "scores: expected a 1-D array"),
    ],
)
def test_bad_inputs_name_argument_index_and_valid_range(kwargs, fragment):
    args = {"scores": [0.5, 0.5, 0.1], "audited": [1, 0, 1], "member": [1, np.nan, 0], "pi": [0.5, 0.5, 0.5]}
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        corrected_membership(**args)
    assert fragment in str(err.value)


def test_member_off_the_audit_is_ignored():
    a = corrected_membership([0.5, 0.4], [1, 0], [1, np.nan], [0.5, 0.5])
    b = corrected_membership([0.5, 0.4], [1, 0], [1, 5.0], [0.5, 0.5])
    assert torch.equal(a, b)


def test_ratio_with_nonpositive_denominator_raises():
    with pytest.raises(ValueError, match="denominator"):
        ratio_estimate([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1, 1], [1.0, 1.0])
