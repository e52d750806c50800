"""crucible.heads: the C chosen by cross-validation, and a head on raw features that is exactly the
logistic regression fitted on standardised ones."""

import numpy as np
import pytest
from scipy.special import expit, softmax

from crucible.heads import C_GRID, choose_C, fit_linear_head, fit_probe_cv


def blobs(n_per_class: int, n_classes: int, d: int = 8, spread: float = 1.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 3, size=(n_classes, d))
    x = np.concatenate([c + spread * rng.normal(size=(n_per_class, d)) for c in centres])
    # a raw scale and offset far from standard, as pooled transformer features are
    return x * 5.0 + 7.0, np.repeat(np.arange(n_classes), n_per_class)


def test_choose_C_takes_the_best_cross_validated_C_and_the_smaller_of_ties():
    x, y = blobs(10, 2)
    table = {0.01: 0.6, 0.1: 0.8, 1.0: 0.8, 10.0: 0.7, 100.0: 0.5}
    C, acc = choose_C(x, y, lambda xt, yt, xv, yv, C: table[C])
    assert (C, acc) == (0.1, 0.8)
    calls = []
    choose_C(x, y, lambda xt, yt, xv, yv, C: calls.append((len(xt), len(xv))) or 0.0, Cs=(1.0,), folds=4)
    assert calls == [(15, 5)] * 4  # 4 stratified folds of 20 rows


def test_choose_C_without_two_rows_of_every_class_takes_the_middle_of_the_grid():
    x, y = blobs(5, 2)
    y = y.copy()
    y[0] = 2  # a class of one row
    C, acc = choose_C(x, y, lambda *a: 1.0)
    assert C == C_GRID[len(C_GRID) // 2] and np.isnan(acc)


def scaled(x):
    """x centred and divided by one number, its RMS deviation (how fit_linear_head scales)."""
    mu = x.mean(0)
    return mu, np.sqrt(np.mean((x - mu) ** 2))


def test_the_head_on_raw_features_is_the_regression_on_scaled_ones():
    from sklearn.linear_model import LogisticRegression

    x, y = blobs(30, 3, spread=3.0, seed=1)
    head = fit_linear_head(x, y, 3, seed=0)
    assert head.weight.shape == (3, 8) and head.bias.shape == (3,)
    assert head.C in C_GRID
    mu, sd = scaled(x)
    ref = LogisticRegression(C=head.C, max_iter=5000).fit((x - mu) / sd, y)
    ours = softmax(x @ head.weight.T.astype(np.float64) + head.bias, axis=1)
    np.testing.assert_allclose(ours, ref.predict_proba((x - mu) / sd), atol=1e-4)


def test_a_binary_head_splits_the_logit_symmetrically_and_keeps_the_sigmoid():
    from sklearn.linear_model import LogisticRegression

    x, y = blobs(25, 2, spread=4.0, seed=2)
    head = fit_linear_head(x, y, 2)
    np.testing.assert_allclose(head.weight[0], -head.weight[1], rtol=1e-6)
    mu, sd = scaled(x)
    ref = LogisticRegression(C=head.C, max_iter=5000).fit((x - mu) / sd, y)
    logits = x @ head.weight.T.astype(np.float64) + head.bias
    np.testing.assert_allclose(softmax(logits, axis=1)[:, 1], expit(ref.decision_function((x - mu) / sd)), atol=1e-4)


def test_a_near_constant_feature_gets_no_outsized_weight():
    # a pooled feature with a tiny spread: scaled per dimension it would get a weight ~1e7
    x, y = blobs(30, 2, seed=5)
    x[:, 0] = 3.0 + 1e-7 * np.random.default_rng(0).normal(size=len(x))
    head = fit_linear_head(x, y, 2)
    assert np.abs(head.weight).max() < 100 * np.abs(head.weight[:, 1:]).max()


def test_a_class_absent_from_the_rows_is_never_predicted():
    x, y = blobs(20, 2, seed=3)
    head = fit_linear_head(x, y * 2, 3)  # classes 0 and 2 of 3
    assert set(head.predict(x + np.random.default_rng(0).normal(size=x.shape) * 10)) <= {0, 2}
    assert (head.predict(x) == y * 2).mean() > 0.95


def test_the_probe_with_C_by_cross_validation_separates_separable_classes():
    x, y = blobs(20, 4, seed=4)
    fit = fit_probe_cv(x, np.array(["a", "b", "c", "d"])[y])
    assert fit.C in C_GRID and fit.cv_accuracy > 0.9
    assert fit.probe.accuracy(x, np.array(["a", "b", "c", "d"])[y]) == 1.0


@pytest.mark.parametrize(
    "x, y, match",
    [
        (np.zeros((4, 2)), np.zeros(4), "single class"),
        (np.full((2, 2), np.nan), np.array([0, 1]), "non-finite"),
        (np.zeros((3, 2)), np.array([0, 1]), "one label per row"),
    ],
)
def test_bad_rows_are_refused(x, y, match):
    with pytest.raises(ValueError, match=match):
        fit_linear_head(x, y, 2)


def test_labels_outside_the_classes_are_refused():
    x, y = blobs(5, 2)
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\)"):
        fit_linear_head(x, y + 1, 2)
