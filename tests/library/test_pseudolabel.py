"""crucible.pseudolabel: estimators by exact enumeration, selection, weights, calibration, errors."""

import itertools

import numpy as np
import pytest

from crucible import pseudolabel as pl

# a tiny pool: 6 items, 2 classes; class index of the true label (-1 for non-members)
S = np.array([0.9, 0.3, 0.6, 0.2, 0.8, 0.5])
M = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
Y = np.array([0, -1, 1, 1, -1, 0])
PI = np.array([0.5, 0.6, 1.0, 0.4, 0.7, 0.8])
P1 = np.array([0.2, 0.6, 0.9, 0.4, 0.3, 0.55])  # the teacher's probability of class 1
PRED = pl.Predictions(label=(P1 > 0.5).astype(int), confidence=np.maximum(P1, 1 - P1), proba=np.c_[1 - P1, P1])
SEL = np.array([True, False, True, False, True, True])
CLASSES = ("a", "b")


def all_audits(pi):
    for bits in itertools.product([0.0, 1.0], repeat=len(pi)):
        i = np.array(bits)
        yield i, float(np.prod(np.where(i == 1, pi, 1 - pi)))


def test_estimates_are_design_unbiased_by_exact_enumeration():
    truth = pl.true_quality(PRED, CLASSES, M, Y, SEL)
    correct = (M == 1) & (Y == PRED.label)
    oracle = {
        "accuracy": (correct.sum(), M.sum()),
        "selected_accuracy": ((correct & SEL).sum(), (M * SEL).sum()),
        "prior_a": (((M == 1) & (Y == 0)).sum(), M.sum()),
        "prior_b": (((M == 1) & (Y == 1)).sum(), M.sum()),
    }
    means = {k: np.zeros(2) for k in oracle}
    total = 0.0
    for i, prob in all_audits(PI):
        # the audit reveals M and the label of audited members only
        q = pl.estimate_quality(PRED, CLASSES, S, i, np.where(i == 1, M, np.nan), np.where(i == 1, Y, -1), PI, SEL)
        ests = {
            "accuracy": q.accuracy,
            "selected_accuracy": q.selected_accuracy,
            "prior_a": q.prior["a"],
            "prior_b": q.prior["b"],
        }
        for k, est in ests.items():
            means[k] += prob * np.array([est.numerator, est.denominator])
        total += prob
    assert total == pytest.approx(1.0)
    for k, (num, den) in oracle.items():
        np.testing.assert_allclose(means[k], [num, den], atol=1e-12, err_msg=k)
        assert truth[k] == pytest.approx(num / den)
    # a full audit returns the estimands exactly, with zero standard error
    full = pl.estimate_quality(PRED, CLASSES, S, np.ones(6), M, Y, np.ones(6), SEL).to_dict()
    for k, v in truth.items():
        assert full[k] == pytest.approx(v) and full[f"{k}_se"] == 0.0


def test_proxy_matters_only_off_the_audit():
    # with a perfect proxy (s = M, confidence = correctness) the estimate is exact whatever the audit
    perfect = pl.Predictions(PRED.label, ((M == 1) & (Y == PRED.label)).astype(float), PRED.proba)
    q = pl.estimate_quality(perfect, CLASSES, M, np.array([1, 0, 0, 1, 0, 0]), M, np.where(M == 1, Y, -1), PI, SEL)
    assert q.accuracy.value == pytest.approx(pl.true_quality(perfect, CLASSES, M, Y, SEL)["accuracy"])
    assert q.accuracy.se == pytest.approx(0.0)


def test_interval_coverage_under_repeated_audits():
    rng = np.random.default_rng(5)
    n, k = 600, 3
    member = (rng.random(n) < 0.7).astype(float)
    proba = rng.dirichlet(np.ones(k) * 0.7, size=n)
    pred = pl.Predictions(proba.argmax(1), proba.max(1), proba)
    y = np.where(member == 1, [rng.choice(k, p=p) for p in proba], -1)
    s = np.clip(0.5 * member + 0.5 * rng.random(n), 0, 1)
    sel = pred.confidence > 0.5
    truth = pl.true_quality(pred, ("a", "b", "c"), member, y, sel)
    pi = np.full(n, 0.15)
    hits = 0
    for _ in range(200):
        i = (rng.random(n) < pi).astype(float)
        q = pl.estimate_quality(pred, ("a", "b", "c"), s, i, member, y, pi, sel)
        hits += q.accuracy.ci_low <= truth["accuracy"] <= q.accuracy.ci_high
    assert 0.88 <= hits / 200 <= 0.99


def test_threshold_selection_keeps_exactly_the_confident():
    conf = np.array([0.5, 0.91, 0.7, 0.9, 0.89])
    np.testing.assert_array_equal(pl.select_by_threshold(conf, 0.9), [False, True, False, True, False])


def test_quota_caps_each_class_and_keeps_the_most_confident():
    rng = np.random.default_rng(0)
    label = np.r_[np.zeros(50, int), np.ones(8, int), np.full(2, 2)]  # class 0 is the majority
    conf = rng.uniform(0.4, 1.0, size=len(label))
    keep = pl.select_by_quota(label, conf, 5, threshold=0.45)
    for k in range(3):
        rows = np.flatnonzero((label == k) & (conf >= 0.45))
        kept = np.flatnonzero(keep & (label == k))
        assert len(kept) == min(5, len(rows))
        # nothing left out is more confident than something kept
        if len(kept) < len(rows):
            assert conf[kept].min() >= conf[np.setdiff1d(rows, kept)].max()
    assert not keep[conf < 0.45].any()
    pred = pl.Predictions(label, conf, np.zeros((len(label), 3)))
    np.testing.assert_array_equal(pl.select(pred, mode="quota", threshold=0.45, quota=5), keep)


def test_weights_are_finite_nonnegative_and_capped():
    m = np.array([0.3, -2.4, 14.0, 0.0, 1.7, 0.9])
    conf = np.array([0.8, 0.9, 0.6, 0.7, 0.55, 1.0])
    audited = np.array([0, 1, 1, 0, 1, 0])
    member = np.array([np.nan, 0, 1, np.nan, 1, np.nan])
    w = pl.training_weights(m, conf, audited, member, w_max=5.0)
    assert np.all(np.isfinite(w)) and np.all(w >= 0) and np.all(w <= 5.0)
    # unaudited: m x confidence; audited non-member: dropped; audited members: capped m, confidence 1
    np.testing.assert_allclose(w, [0.24, 0.0, 5.0, 0.0, 1.7, 0.9])
    with pytest.raises(ValueError, match="w_max"):
        pl.training_weights(m, conf, audited, member, w_max=0.0)


def test_audited_members_carry_their_true_labels():
    label, from_audit = pl.final_labels(PRED.label, [1, 1, 1, 0, 0, 1], M, np.where(M == 1, Y, -1))
    np.testing.assert_array_equal(from_audit, [True, False, True, False, False, True])
    np.testing.assert_array_equal(label[from_audit], Y[from_audit])
    np.testing.assert_array_equal(label[~from_audit], PRED.label[~from_audit])
    assert (PRED.label[from_audit] != Y[from_audit]).any()  # the test would notice pseudo-labels kept
    with pytest.raises(ValueError, match="audited member at pool position 0 has no label"):
        pl.final_labels(PRED.label, [1, 0, 0, 0, 0, 0], M, np.full(6, -1))


def _blobs(seed, n=300, d=5, k=3):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=1.5, size=(k, d))
    y = rng.integers(0, k, size=n)
    return centers[y] + rng.normal(size=(n, d)), np.array(["c0", "c1", "c2"], dtype=object)[y]


def test_temperature_scaling_lowers_heldout_nll_of_an_overconfident_model():
    rng = np.random.default_rng(1)
    true_logits = rng.normal(scale=1.5, size=(4000, 4))
    y = np.array([rng.choice(4, p=p) for p in np.exp(true_logits) / np.exp(true_logits).sum(1, keepdims=True)])
    logits = 4.0 * true_logits  # over-confident by a factor 4
    t = pl.fit_temperature(logits[:2000], y[:2000])
    assert 3.3 < t < 4.8
    assert pl.nll(logits[2000:], y[2000:], t) < pl.nll(logits[2000:], y[2000:], 1.0) - 0.1


def test_teacher_is_deterministic_and_calibrated_on_the_dev_rows():
    x, labels = _blobs(2)
    dev = pl.dev_split(labels, 0.3, seed=3)
    a = pl.fit_teacher(x, labels, dev=dev, seed=3, C=1e4)
    b = pl.fit_teacher(x, labels, dev=dev, seed=3, C=1e4)
    assert a.temperature == b.temperature
    np.testing.assert_array_equal(a.coef, b.coef)
    np.testing.assert_array_equal(pl.predict(a, x).proba, pl.predict(b, x).proba)
    assert a.classes == ("c0", "c1", "c2") and a.calibration.n_dev == int(dev.sum()) == pytest.approx(90, abs=3)
    assert a.n_fit == len(x) - int(dev.sum())
    assert a.calibration.dev_nll <= a.calibration.dev_nll_uncalibrated
    p = pl.predict(a, x)
    np.testing.assert_allclose(p.proba.sum(1), 1.0)
    np.testing.assert_array_equal(p.confidence, p.proba.max(1))
    # C: null is chosen by cross-validation on the training rows, from the grid
    from crucible.heads import C_GRID

    assert pl.fit_teacher(x, labels, dev=dev, seed=3).C in C_GRID


def test_calibration_of_any_teachers_logits_is_the_temperature_fit():
    rng = np.random.default_rng(2)
    logits = rng.normal(scale=3, size=(300, 3))
    y = logits.argmax(1)
    y[:60] = (y[:60] + 1) % 3  # 20 % wrong: the logits are over-confident
    cal = pl.calibrate(logits, y)
    assert cal.temperature == pytest.approx(pl.fit_temperature(logits, y))
    assert cal.dev_accuracy == pytest.approx(0.8) and cal.n_dev == 300
    assert cal.dev_nll == pytest.approx(pl.nll(logits, y, cal.temperature))
    assert cal.dev_nll < cal.dev_nll_uncalibrated
    pred = pl.predict_logits(logits, cal.temperature)
    np.testing.assert_array_equal(pred.label, logits.argmax(1))
    from scipy.special import softmax

    np.testing.assert_allclose(pred.proba, softmax(logits / cal.temperature, axis=1))


def test_the_dev_split_is_stratified_seeded_and_leaves_every_class_a_training_row():
    labels = np.array(["a"] * 40 + ["b"] * 20 + ["c"] * 2 + ["d"], dtype=object)
    dev = pl.dev_split(labels, 0.25, seed=1)
    assert [int(dev[labels == k].sum()) for k in "abcd"] == [10, 5, 1, 0]
    assert np.array_equal(dev, pl.dev_split(labels, 0.25, seed=1))
    assert not np.array_equal(dev, pl.dev_split(labels, 0.25, seed=2))
    with pytest.raises(ValueError, match=r"dev fraction: 1.0; valid values are in \(0, 1\)"):
        pl.dev_split(labels, 1.0, seed=0)


def test_target_selection_keeps_the_longest_confident_prefix_of_the_expected_accuracy():
    conf = np.array([0.99, 0.6, 0.95, 0.7, 0.9, 0.5])
    # sorted 0.99, 0.95, 0.9, 0.7, 0.6, 0.5: running means 0.99, 0.97, 0.9467, 0.885, 0.828, 0.775
    np.testing.assert_array_equal(pl.select_by_target(conf, 0.9), [1, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(pl.select_by_target(conf, 0.885), [1, 0, 1, 1, 1, 0])
    assert pl.select_by_target(conf, 0.5).all()
    assert not pl.select_by_target(conf, 0.995).any()  # even the most confident is below the target
    # ties with the last kept item are kept too
    np.testing.assert_array_equal(pl.select_by_target(np.array([0.9, 0.8, 0.8, 0.5]), 0.84), [1, 1, 1, 0])
    pred = pl.Predictions(np.zeros(6, int), conf, np.stack([conf, 1 - conf], 1))
    np.testing.assert_array_equal(pl.select(pred, mode="target", threshold=0.0, target=0.9), [1, 0, 1, 0, 1, 0])


def test_binary_teacher_matches_the_logistic_sigmoid():
    x, labels = _blobs(4, k=2)
    labels = np.where(labels == "c0", "neg", "pos").astype(object)
    t = pl.fit_teacher(x, labels, dev=pl.dev_split(labels, 0.3, seed=0), seed=0)
    np.testing.assert_allclose(t.coef[0], -t.coef[1])  # one logit, split symmetrically over the two rows
    z = x @ (t.coef[1] - t.coef[0]) + (t.intercept[1] - t.intercept[0])
    np.testing.assert_allclose(t.proba(x)[:, 1], 1 / (1 + np.exp(-z / t.temperature)))


def test_single_class_reference_is_refused():
    x, _ = _blobs(0, n=20)
    with pytest.raises(
        ValueError,
        match=r"ref.parquet, column 'label': all 20 rows have the single class 'pos'; "
        r"expected labeled rows of at least two classes",
    ):
        pl.fit_teacher(x, np.array(["pos"] * 20, dtype=object), dev=np.zeros(20, bool), source="ref.parquet")


def test_audit_label_outside_the_classes_is_refused():
    with pytest.raises(
        ValueError,
        match=r"audit.parquet: row 2 has label 'sport', which is not one of the "
        r"task's classes \['a', 'b'\]",
    ):
        pl.label_indices(np.array(["a", None, "sport"], dtype=object), ("a", "b"), source="audit.parquet")
    np.testing.assert_array_equal(pl.label_indices(np.array(["b", None, "a"], dtype=object), ("a", "b")), [1, -1, 0])


def test_an_empty_selection_has_no_selected_accuracy():
    q = pl.estimate_quality(PRED, CLASSES, S, np.ones(6), M, Y, np.ones(6), np.zeros(6, bool))
    assert q.selected_accuracy is None and "selected_accuracy" not in q.to_dict() and "accuracy" in q.to_dict()
    assert not pl.select_by_threshold(PRED.confidence, 0.99).any()


def test_bad_selection_mode_target_and_dev_mask():
    with pytest.raises(ValueError, match="selection mode 'top'"):
        pl.select(PRED, mode="top", threshold=0.5)
    with pytest.raises(ValueError, match=r"target_accuracy: 0; valid values are in \(0, 1\]"):
        pl.select_by_target(PRED.confidence, 0)
    x, labels = _blobs(0)
    with pytest.raises(ValueError, match="the dev mask must mark some but not all"):
        pl.fit_teacher(x, labels, dev=np.ones(len(labels), bool))
