"""The three evaluation interfaces (head, probe, separability) and their metrics."""

import math

import numpy as np
import pytest

from crucible.continual import accuracy_curve, average_accuracy, backward_transfer
from crucible.evaluation import (
    ALGORITHMS,
    ari,
    cluster,
    continual_by_interface,
    fit_probe,
    head_accuracy,
    interface_scores,
    nmi,
    probe_accuracy,
    separability,
)

K, D = 4, 16


def gaussian_task(seed=0, n=200, k=K, d=D, spread=4.0):
    """Well-separated Gaussian classes: train and test splits (float32) and the nearest-mean head."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(k, d)) * spread

    def draw(m):
        y = np.repeat(np.arange(k), m // k)
        return (means[y] + rng.normal(size=(m, d))).astype(np.float32), y

    train_x, train_y = draw(n)
    test_x, test_y = draw(n)
    weight = means.astype(np.float32)
    bias = (-0.5 * (means**2).sum(axis=1)).astype(np.float32)
    return train_x, train_y, test_x, test_y, weight, bias


def l2(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# -- nmi / ari -------------------------------------------------------------------------------------


def _h(*p):
    """Entropy (natural log) of a distribution."""
    return -sum(q * math.log(q) for q in p)


@pytest.mark.parametrize(
    "a, b, want_nmi, want_ari",
    [
        ([0] * 6, [0] * 6, 1.0, 1.0),  # one cluster each side
        ([0] * 6, [5] * 6, 1.0, 1.0),
        (list(range(6)), list(range(6)), 1.0, 1.0),  # all singletons each side
        (list(range(6)), [0] * 6, 0.0, 0.0),  # singletons vs one cluster
        ([0] * 6, list(range(6)), 0.0, 0.0),
        ([0, 0, 1, 1, 2, 2], [0] * 6, 0.0, 0.0),  # one side one cluster only
        # pred refines true: MI = H(true) = log 3, H(pred) = log 6; no pair is together in pred
        ([0, 0, 1, 1, 2, 2], list(range(6)), 2 * math.log(3) / math.log(18), 0.0),
        ([3], [9], 1.0, 1.0),  # one row
        ([], [], 1.0, 1.0),  # no rows
        # pred is a function of true (cat, eel -> x; dog -> y): MI = H(pred); pairs: together in both 2,
        # in true 2, in pred 4, of 10: ARI = (2 - 0.8) / (3 - 0.8)
        (
            ["cat", "dog", "dog", "cat", "eel"],
            ["x", "y", "y", "x", "x"],
            2 * _h(0.6, 0.4) / (_h(0.4, 0.4, 0.2) + _h(0.6, 0.4)),
            1.2 / 2.2,
        ),
        (["b", "a", "a", "c"], [2, 0, 0, 1], 1.0, 1.0),  # strings vs ints, the same partition
        ([0, 1, 0, 1], [0, 0, 1, 1], 0.0, -0.5),  # independent: NMI 0, ARI negative
        # pred refines true: NMI = 2 log 2 / (log 2 + 1.5 log 2); pairs 1, 2, 1 of 6: ARI = (2/3) / (7/6)
        ([0, 0, 1, 1], [0, 0, 1, 2], 0.8, 4 / 7),
    ],
)
def test_nmi_ari_values_and_edge_cases(a, b, want_nmi, want_ari):
    assert nmi(a, b) == pytest.approx(want_nmi, abs=1e-12, rel=0)
    assert ari(a, b) == pytest.approx(want_ari, abs=1e-12, rel=0)
    assert nmi(b, a) == pytest.approx(want_nmi, abs=1e-12, rel=0)  # both are symmetric
    assert type(nmi(a, b)) is float and type(ari(a, b)) is float


def test_nmi_ari_string_labels_map_like_their_codes():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 4, 80), rng.integers(0, 3, 80)
    names = np.array(["ant", "bee", "cow", "dog"])
    assert nmi(names[a], b) == nmi(a, b) and ari(names[a], b) == ari(a, b)
    mixed = np.array([("x" if v == 0 else v) for v in a.tolist()], dtype=object)  # unorderable mix
    assert nmi(mixed, b) == pytest.approx(nmi(a, b), abs=1e-15)
    assert ari(mixed, b) == pytest.approx(ari(a, b), abs=1e-15)
    assert nmi(a, b) < 0.2 and nmi(a, a) == 1.0


def test_nmi_ari_bad_input():
    with pytest.raises(ValueError, match="same length"):
        nmi([0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="labels_true must be a 1-D"):
        ari([[0, 1], [1, 0]], [0, 1])
    with pytest.raises(ValueError, match="labels_pred must be a 1-D"):
        nmi([0, 1], [[0, 1]])


# -- head ------------------------------------------------------------------------------------------


def test_head_accuracy_hand_example():
    features = np.array([[1, 0], [0, 1], [1, 1], [-1, 0]], dtype=np.float32)
    weight = np.array([[1, 0], [0, 1], [-1, 0]], dtype=np.float32)
    labels = np.array([0, 1, 0, 2])
    # logits with bias (0, .5, 0): [1, .5, -1] [0, 1.5, 0] [1, 1.5, -1] [-1, .5, 1] -> 0 1 1 2
    assert head_accuracy(features, weight, [0.0, 0.5, 0.0], labels) == 0.75
    # without bias row 2 ties 1 = 1 between classes 0 and 1: argmax takes the lower, class 0
    assert head_accuracy(features, weight, np.zeros(3), labels) == 1.0
    assert head_accuracy(features, weight, np.zeros(3), [1, 1, 1, 1]) == 0.25
    assert type(head_accuracy(features, weight, np.zeros(3), labels)) is float


def test_head_accuracy_bad_input():
    x, w, b, y = np.ones((4, 3)), np.ones((2, 3)), np.zeros(2), np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"weight must have shape \(k, 3\).*\(2, 5\)"):
        head_accuracy(x, np.ones((2, 5)), b, y)
    with pytest.raises(ValueError, match=r"bias must .* shape \(2,\).*\(3,\)"):
        head_accuracy(x, w, np.zeros(3), y)
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 2\).*e\.g\. 2"):
        head_accuracy(x, w, b, [0, 1, 2, 1])
    with pytest.raises(ValueError, match="labels must have one label per feature row"):
        head_accuracy(x, w, b, [0, 1])
    with pytest.raises(ValueError, match="labels must be integer class indices"):
        head_accuracy(x, w, b, ["a", "b", "a", "b"])
    bad = x.copy()
    bad[0, 0], bad[2, 1] = np.nan, np.inf
    with pytest.raises(ValueError, match="features has 2 non-finite values"):
        head_accuracy(bad, w, b, y)
    with pytest.raises(ValueError, match=r"features must be a non-empty 2-D array.*\(4,\)"):
        head_accuracy(np.ones(4), w, b, y)


# -- probe -----------------------------------------------------------------------------------------


def leak_task(seed=0, n=200, k=K, d=D):
    """Training features carry no label information (noise in dims :8, zero in dims 8:); test
    features are zero in dims :8 and perfectly separable by their labels in dims 8:."""
    rng = np.random.default_rng(seed)
    train_x = np.zeros((n, d))
    train_x[:, : d // 2] = rng.normal(size=(n, d // 2))
    train_y = rng.permutation(np.repeat(np.arange(k), n // k))
    test_y = np.repeat(np.arange(k), n // k)
    means = rng.normal(size=(k, d - d // 2)) * 5
    test_x = np.zeros((n, d))
    test_x[:, d // 2 :] = means[test_y] + 0.1 * rng.normal(size=(n, d - d // 2))
    return train_x, train_y, test_x, test_y


def test_probe_fits_on_training_rows_only():
    train_x, train_y, test_x, test_y = leak_task()
    for normalize in (True, False):
        acc = probe_accuracy(train_x, train_y, test_x, test_y, normalize=normalize)
        # every test row gets the same prediction: chance for 4 balanced classes, exactly
        assert acc == 0.25
        # a probe that had seen the test rows would have been near-perfect: the test can fail
        leaky = fit_probe(np.vstack([train_x, test_x]), np.concatenate([train_y, test_y]), normalize=normalize)
        assert leaky.accuracy(test_x, test_y) > 0.9


def test_probe_predictions_do_not_depend_on_test_labels():
    train_x, train_y, test_x, test_y, _, _ = gaussian_task(seed=3, spread=0.6)  # overlapping classes
    predicted = fit_probe(train_x, train_y).predict(test_x)
    assert 0.4 < np.mean(predicted == test_y) < 1.0  # neither trivial nor perfect
    rng = np.random.default_rng(0)
    for y in [test_y, rng.permutation(test_y), rng.integers(0, K, len(test_y)), np.zeros_like(test_y)]:
        # if probe_accuracy fitted anything on (test_x, y) its predictions would move with y
        assert probe_accuracy(train_x, train_y, test_x, y) == float(np.mean(predicted == y))
    assert np.array_equal(fit_probe(train_x, train_y).predict(test_x), predicted)


def test_probe_scaler_and_model_fitted_on_training_rows():
    train_x, train_y, test_x, _, _, _ = gaussian_task(seed=4)
    for normalize, seen in ((True, l2(train_x.astype(np.float64))), (False, train_x.astype(np.float64))):
        probe = fit_probe(train_x, train_y, normalize=normalize)
        assert probe.scaler.n_samples_seen_ == len(train_x)
        np.testing.assert_allclose(probe.scaler.mean_, seen.mean(axis=0), rtol=0, atol=1e-12)
        np.testing.assert_allclose(probe.scaler.scale_, seen.std(axis=0), rtol=1e-10)
        assert list(probe.classes) == [0, 1, 2, 3] and probe.model.n_iter_.max() < probe.model.max_iter
    # normalize=True: rows are L2-normalised first, so rescaling rows changes nothing
    scale = np.random.default_rng(0).uniform(0.1, 10, (len(train_x), 1))
    a = fit_probe(train_x, train_y).predict(test_x)
    b = fit_probe(train_x * scale, train_y).predict(test_x * scale[: len(test_x)])
    assert np.array_equal(a, b)


def test_probe_string_labels_and_unseen_labels():
    train_x, train_y, test_x, test_y, _, _ = gaussian_task(seed=5)
    names = np.array(["rock", "paper", "scissors", "lizard"])
    probe = fit_probe(train_x, names[train_y])
    assert sorted(probe.classes.tolist()) == sorted(names.tolist())
    assert set(probe.predict(test_x).tolist()) <= set(names.tolist())
    assert probe.accuracy(test_x, names[test_y]) == probe_accuracy(train_x, train_y, test_x, test_y) > 0.95
    unseen = names[test_y].astype(object)
    unseen[test_y == 0] = "spock"  # a label never seen in training is always wrong
    assert probe.accuracy(test_x, unseen) == pytest.approx(probe.accuracy(test_x, names[test_y]) - 0.25, abs=0.02)


def test_probe_bad_input():
    train_x, train_y, test_x, test_y, _, _ = gaussian_task(seed=6, n=40)
    with pytest.raises(ValueError, match=r"train_y must hold at least 2 distinct classes.*got 1"):
        fit_probe(train_x, np.full(len(train_x), 3))
    with pytest.raises(ValueError, match="train_y must have one label per feature row"):
        probe_accuracy(train_x, train_y[:-1], test_x, test_y)
    with pytest.raises(ValueError, match="test_y must have one label per feature row"):
        probe_accuracy(train_x, train_y, test_x, test_y[:5])
    with pytest.raises(ValueError, match=r"test_x must have 16 features like train_x.*\(40, 3\)"):
        probe_accuracy(train_x, train_y, test_x[:, :3], test_y)
    bad = train_x.copy()
    bad[:3, 0] = np.nan
    with pytest.raises(ValueError, match="train_x has 3 non-finite values"):
        fit_probe(bad, train_y)
    bad = test_x.copy()
    bad[1, 1] = -np.inf
    with pytest.raises(ValueError, match="test_x has 1 non-finite values"):
        probe_accuracy(train_x, train_y, bad, test_y)
    with pytest.raises(ValueError, match="C must be a finite positive number"):
        fit_probe(train_x, train_y, C=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        fit_probe(train_x, train_y, seed=-1)


# -- separability ----------------------------------------------------------------------------------


def test_separability_of_separated_clusters_and_of_random_labels():
    _, _, test_x, test_y, _, _ = gaussian_task(seed=7)
    sep = separability(test_x, test_y, ALGORITHMS)
    assert set(sep) == set(ALGORITHMS)
    for scores in sep.values():
        assert scores["nmi"] > 0.99 and scores["ari"] > 0.99
    random_labels = np.random.default_rng(0).integers(0, K, len(test_y))
    for scores in separability(test_x, random_labels, ALGORITHMS).values():
        assert scores["nmi"] < 0.06 and abs(scores["ari"]) < 0.03
    assert separability(test_x, np.array(["a", "b", "c", "d"])[test_y]) == separability(test_x, test_y)


def test_spectral_follows_the_neighbour_graph():
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1], 100)
    angle = rng.uniform(0, 2 * np.pi, 200)
    radius = np.where(y == 0, 1.0, 3.0)  # two concentric rings: connected, not convex
    x = np.c_[radius * np.cos(angle), radius * np.sin(angle)] + 0.1 * rng.normal(size=(200, 2))
    raw = separability(x, y, ALGORITHMS, normalize=False)
    assert raw["spectral"] == {"nmi": 1.0, "ari": 1.0}
    assert raw["kmeans"]["nmi"] < 0.05 and raw["agglomerative"]["ari"] < 0.5
    # L2 normalisation puts both rings on the unit circle: nothing is left to separate
    assert separability(x, y, ("spectral",))["spectral"]["nmi"] < 0.05


def test_cluster_k_range_and_algorithms():
    x = np.random.default_rng(0).normal(size=(12, 5))
    for alg in ALGORITHMS:
        labels = cluster(x, 3, alg)
        assert labels.shape == (12,) and labels.dtype == np.int64 and set(labels.tolist()) <= {0, 1, 2}
        assert labels[0] == 0  # renumbered by first appearance
        assert np.array_equal(cluster(x, 1, alg), np.zeros(12, dtype=np.int64))
        assert np.array_equal(cluster(x, 12, alg), np.arange(12))
    for k in (0, 13, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"k must be an integer in \[2, n=12\].*got {k!r}"):
            cluster(x, k)
    with pytest.raises(ValueError, match=r"algorithm: unknown algorithm 'dbscan'; valid: \('kmeans'"):
        cluster(x, 3, "dbscan")
    with pytest.raises(ValueError, match=r"algorithms: unknown algorithm 'birch'"):
        separability(x, np.arange(12) % 3, ("kmeans", "birch"))
    with pytest.raises(ValueError, match="algorithms must be a sequence of names, got the string 'kmeans'"):
        separability(x, np.arange(12) % 3, "kmeans")
    bad = x.copy()
    bad[4, 2] = np.nan
    with pytest.raises(ValueError, match="x has 1 non-finite values"):
        cluster(bad, 3)
    with pytest.raises(ValueError, match=r"labels must have one label per feature row \(12\), got 11"):
        separability(x, np.arange(11) % 3)


def test_normalize_rescaled_rows_and_zero_rows():
    _, _, test_x, test_y, _, _ = gaussian_task(seed=8)
    scaled = test_x * np.random.default_rng(1).uniform(0.2, 5.0, (len(test_x), 1))
    for alg in ALGORITHMS:
        assert np.array_equal(cluster(test_x, K, alg), cluster(scaled, K, alg))
    # without normalisation the row norms are part of the geometry: kmeans sees different data
    assert not np.array_equal(cluster(test_x, K, normalize=False), cluster(scaled, K, normalize=False))
    with_zero = test_x.copy()
    with_zero[0] = 0.0  # stays zero, produces no NaN
    assert all(0 <= v <= 1 for s in separability(with_zero, test_y, ALGORITHMS).values() for v in s.values())
    assert 0 <= probe_accuracy(with_zero, test_y, with_zero, test_y) <= 1


# -- all three -------------------------------------------------------------------------------------


def test_interfaces_are_independent_of_the_head():
    train_x, train_y, test_x, test_y, weight, bias = gaussian_task(seed=0)
    good = interface_scores(test_x, test_y, weight, bias, train_x, train_y)
    assert good["head"] > 0.95 and good["probe"] > 0.95 and good["kmeans_nmi"] > 0.95
    perm = np.roll(np.arange(K), 1)  # the head's label mapping shuffled: no class keeps its row
    shuffled = interface_scores(test_x, test_y, weight[perm], bias[perm], train_x, train_y)
    assert shuffled["head"] < 0.1
    assert {key: v for key, v in shuffled.items() if key != "head"} == {
        key: v for key, v in good.items() if key != "head"
    }
    # the head sees raw features even with normalize=True; on normalised rows it would do worse
    assert good["head"] == head_accuracy(test_x, weight, bias, test_y)
    assert head_accuracy(l2(test_x), weight, bias, test_y) < good["head"] - 0.2


def test_interface_scores_keys_and_determinism():
    train_x, train_y, test_x, test_y, weight, bias = gaussian_task(seed=9, spread=1.0)
    scores = interface_scores(test_x, test_y, weight, bias, train_x, train_y)
    assert list(scores) == ["head", "probe", "kmeans_nmi", "kmeans_ari", "agglomerative_nmi", "agglomerative_ari"]
    assert all(type(v) is float and math.isfinite(v) for v in scores.values())
    everything = interface_scores(test_x, test_y, weight, bias, train_x, train_y, algorithms=ALGORITHMS, seed=3)
    assert list(everything) == ["head", "probe"] + [f"{a}_{m}" for a in ALGORITHMS for m in ("nmi", "ari")]
    again = interface_scores(test_x, test_y, weight, bias, train_x, train_y, algorithms=ALGORITHMS, seed=3)
    assert again == everything
    assert list(interface_scores(test_x, test_y, weight, bias, train_x, train_y, algorithms=["spectral"])) == [
        "head",
        "probe",
        "spectral_nmi",
        "spectral_ari",
    ]
    for alg in ALGORITHMS:
        assert np.array_equal(cluster(test_x, K, alg, seed=5), cluster(test_x, K, alg, seed=5))
    with pytest.raises(ValueError, match=r"train_x must have 16 features like test_x.*\(200, 8\)"):
        interface_scores(test_x, test_y, weight, bias, train_x[:, :8], train_y)
    with pytest.raises(ValueError, match="algorithms must name at least one"):
        interface_scores(test_x, test_y, weight, bias, train_x, train_y, algorithms=())


def test_continual_by_interface_uses_the_continual_metrics():
    nan = float("nan")
    matrices = {"head": [[0.9, nan], [0.3, 0.8]], "probe": [[0.9, nan], [0.85, 0.88]]}
    out = continual_by_interface(matrices)
    for key, R in matrices.items():
        assert out[key] == {"acc": average_accuracy(R), "bwt": backward_transfer(R), "curve": accuracy_curve(R)}
    assert out["head"]["bwt"] == pytest.approx(-0.6) and out["probe"]["bwt"] == pytest.approx(-0.05)
    with pytest.raises(ValueError, match="matrices must be a non-empty mapping"):
        continual_by_interface({})
