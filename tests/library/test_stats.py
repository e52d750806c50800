"""crucible.stats against closed forms (exact McNemar p-values) and by simulation (the coverage of
the paired and the stratified bootstrap intervals on cases whose true difference is known)."""

from math import comb

import numpy as np
import pytest

from crucible.stats import compare_paired, compare_tasks, mcnemar_exact, normalised_accuracy, paired_bootstrap


def outcomes(n01: int, n10: int, n11: int = 0, n00: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A's and B's outcomes with the given cell counts (n01: A right only, n10: B right only)."""
    a = np.array([1] * n01 + [0] * n10 + [1] * n11 + [0] * n00, dtype=bool)
    b = np.array([0] * n01 + [1] * n10 + [1] * n11 + [0] * n00, dtype=bool)
    return a, b


@pytest.mark.parametrize(
    "b, c, expected",
    [
        (1, 9, 2 * (comb(10, 0) + comb(10, 1)) / 2**10),  # 0.021484375
        (9, 1, 2 * (comb(10, 0) + comb(10, 1)) / 2**10),  # symmetric
        (0, 5, 2 / 2**5),
        (3, 3, 1.0),  # 2 P(X <= 3) > 1 for Binomial(6, 1/2): capped
        (0, 0, 1.0),  # the models never disagree
        (10, 25, 2 * sum(comb(35, k) for k in range(11)) / 2**35),
    ],
)
def test_mcnemar_exact_p_value_is_the_binomial_tail(b, c, expected):
    a, bb = outcomes(b, c, n11=40, n00=7)  # concordant rows carry no evidence
    n01, n10, p = mcnemar_exact(a, bb)
    assert (n01, n10) == (b, c)
    assert p == pytest.approx(expected, rel=1e-12)


def test_the_point_difference_is_the_difference_of_accuracies_and_lies_in_its_interval():
    a, b = outcomes(30, 12, n11=100, n00=58)
    cmp = compare_paired(a, b, seed=3)
    assert cmp.a == pytest.approx(130 / 200) and cmp.b == pytest.approx(112 / 200)
    assert cmp.diff == pytest.approx(18 / 200)
    assert cmp.ci_low < cmp.diff < cmp.ci_high
    assert (cmp.a_only, cmp.b_only, cmp.n) == (30, 12, 200)
    assert cmp.significant  # 30 against 12 discordant rows: p ~ 0.008
    assert cmp.p_value == pytest.approx(mcnemar_exact(a, b)[2])
    # the same seed gives the same interval; the interval of B against A is the mirror image
    assert compare_paired(a, b, seed=3) == cmp
    rev = compare_paired(b, a, seed=3)
    assert rev.diff == pytest.approx(-cmp.diff)
    assert rev.ci_low == pytest.approx(-cmp.ci_high) and rev.ci_high == pytest.approx(-cmp.ci_low)


def test_identical_models_have_a_zero_width_interval_and_p_one():
    a = np.array([1, 0, 1, 1, 0, 1], dtype=bool)
    cmp = compare_paired(a, a)
    assert (cmp.diff, cmp.ci_low, cmp.ci_high, cmp.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert not cmp.significant


def draw_pairs(rng, n: int, p01: float, p10: float, p11: float) -> tuple[np.ndarray, np.ndarray]:
    cells = rng.choice(4, size=n, p=[p01, p10, p11, 1 - p01 - p10 - p11])
    return (cells == 0) | (cells == 2), (cells == 1) | (cells == 2)


def test_the_paired_bootstrap_interval_covers_the_true_difference_95_percent_of_the_time():
    # rows drawn from a known joint law: P(A right, B wrong) = 0.15, the reverse 0.10, so the true
    # difference is 0.05; over 400 simulated test sets of 300 rows the 95 % interval should contain
    # it in 95 % of them (binomial sd 1.1 %: 92-97.5 % leaves room for Monte Carlo noise only)
    rng = np.random.default_rng(0)
    hits = 0
    reps = 400
    for r in range(reps):
        a, b = draw_pairs(rng, 300, 0.15, 0.10, 0.55)
        _, lo, hi = paired_bootstrap(a, b, n_boot=2000, seed=r)
        hits += lo <= 0.05 <= hi
    assert 0.92 <= hits / reps <= 0.975, hits / reps


def test_the_stratified_interval_of_the_task_mean_covers_the_true_mean_difference():
    # two tasks of different sizes and true differences 0.10 and -0.02: the mean over tasks is 0.04
    rng = np.random.default_rng(1)
    hits = 0
    reps = 300
    for r in range(reps):
        pairs = {"big": draw_pairs(rng, 400, 0.20, 0.10, 0.50), "small": draw_pairs(rng, 120, 0.08, 0.10, 0.60)}
        mean = compare_tasks(pairs, n_boot=2000, seed=r)["mean"]
        hits += mean.ci_low <= 0.04 <= mean.ci_high
    assert 0.92 <= hits / reps <= 0.98, hits / reps


def test_compare_tasks_gives_each_task_and_their_unweighted_mean():
    pairs = {"x": outcomes(10, 0, n11=90), "y": outcomes(0, 4, n11=16)}
    out = compare_tasks(pairs, n_boot=500)
    assert set(out) == {"x", "y", "mean"}
    assert out["x"].diff == pytest.approx(0.10) and out["y"].diff == pytest.approx(-0.20)
    assert out["mean"].diff == pytest.approx((0.10 - 0.20) / 2)  # every task counts once
    assert out["mean"].a == pytest.approx((1.0 + 0.8) / 2)
    assert out["mean"].p_value is None and out["mean"].n == 120


def test_normalised_accuracy_is_the_mean_ratio_with_an_interval():
    pairs = {"x": outcomes(0, 10, n11=80, n00=10), "y": outcomes(0, 0, n11=50, n00=50)}
    value, lo, hi = normalised_accuracy(pairs, n_boot=500)
    assert value == pytest.approx((80 / 90 + 1.0) / 2)
    assert lo <= value <= hi <= 1.0
    with pytest.raises(ValueError, match="task 'z'.*gets no row right"):
        normalised_accuracy({"z": (np.ones(3, bool), np.zeros(3, bool))})


@pytest.mark.parametrize(
    "a, b, match",
    [
        (np.ones(3, bool), np.ones(4, bool), "same length"),
        (np.ones(0, bool), np.ones(0, bool), "no rows"),
        (np.array([0, 2, 1]), np.array([0, 1, 1]), "must be booleans"),
    ],
)
def test_bad_outcomes_are_refused(a, b, match):
    with pytest.raises(ValueError, match=match):
        compare_paired(a, b)


def test_a_bad_level_is_refused():
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap(np.ones(3, bool), np.ones(3, bool), level=95)
