"""Three evaluation interfaces on frozen features (docs/methods.md, evaluate).

Every model variant (base, each task's fine-tune, each merge after each arrival, the quantized
model) is read through three interfaces on the same frozen features: mean-pooled encoder outputs,
float arrays of shape (n, d). They answer different questions and are allowed to disagree.

    head          accuracy of the task's own trained linear head (weight (k, d), bias (k,)):
                  argmax(x @ weight.T + bias) == y on the test rows. The head sees the raw
                  features, as in training. It measures what the deployed model actually does.
    probe         accuracy of a fresh multinomial logistic-regression probe (lbfgs) fitted on the
                  features of the task's TRAINING rows only (scaler and model alike), scored on the
                  test rows. It measures the label information still linearly recoverable from the
                  features, whatever the head has become.
    separability  a clustering of the test features into k = number of distinct test labels
                  clusters (k-means, Ward agglomerative, spectral), scored against the labels by NMI
                  and ARI. No classifier is fitted; it measures whether the classes form clusters.

A variant that only scrambles its head (e.g. merged heads that no longer line up with the labels)
shows a low head score but unchanged probe and separability; a variant whose features collapse
loses all three. `interface_scores` returns the three side by side for one (variant, task);
`continual_by_interface` turns per-interface accuracy matrices over the arrival order into
crucible.continual's ACC / BWT / curve.

With `normalize=True` (the default) each feature row is L2-normalised (a zero row stays zero)
before the probe's standardisation and before clustering; the head always sees the raw features.

Labels for nmi / ari / separability / the probe may be ints or strings (any hashable values): they
are mapped to indices by np.unique's sorted order, or by first appearance when the values cannot be
sorted (mixed types in an object array). NMI and ARI are invariant to that mapping; the probe
predicts the original label values. `head_accuracy` takes integer class indices in [0, k).

nmi and ari are sklearn.metrics.normalized_mutual_info_score (arithmetic normalisation) and
adjusted_rand_score, applied to the label codes (so labels sklearn cannot sort still work), with
sklearn's edge cases: one cluster on both sides, or no rows, is a perfect match (1.0); one cluster
on one side only gives NMI 0; identical partitions, e.g. all singletons on both sides, give 1.0.

Everything is deterministic given `seed`, and every score is a plain Python float.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crucible.continual import accuracy_curve, average_accuracy, backward_transfer

__all__ = [
    "ALGORITHMS",
    "Probe",
    "ari",
    "cluster",
    "continual_by_interface",
    "fit_probe",
    "head_accuracy",
    "interface_scores",
    "nmi",
    "probe_accuracy",
    "separability",
]

ALGORITHMS = ("kmeans", "agglomerative", "spectral")
PROBE_MAX_ITER = 10_000


# -- validation helpers ---------------------------------------------------------------------------


def _features(x, name: str) -> np.ndarray:
    """A finite, non-empty float64 matrix (n, d), or a ValueError naming `name`."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be a numeric array of shape (n, d), got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array of shape (n, d), got shape {arr.shape}")
    arr = arr.astype(np.float64, copy=False)
    bad = int(np.count_nonzero(~np.isfinite(arr)))
    if bad:
        raise ValueError(f"{name} has {bad} non-finite values (NaN or inf) out of {arr.size}; features must be finite")
    return arr


def _labels_1d(y, name: str, n: int | None = None) -> np.ndarray:
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of labels, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} must have one label per feature row ({n}), got {arr.shape[0]}")
    return arr


def _encode(y: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(classes, codes) with classes[codes] == y: sorted unique values, or first appearance when the
    values cannot be ordered."""
    try:
        classes, codes = np.unique(y, return_inverse=True)
        return classes, codes.reshape(-1).astype(np.int64)
    except TypeError:
        index: dict[Any, int] = {}
        try:
            codes = np.array([index.setdefault(v, len(index)) for v in y.tolist()], dtype=np.int64)
        except TypeError as err:
            raise ValueError(f"{name} must hold hashable label values: {err}") from None
        classes = np.empty(len(index), dtype=object)
        classes[:] = list(index)
        return classes, codes


def _class_indices(y, name: str, n: int, k: int) -> np.ndarray:
    """Integer class indices in [0, k) (integral floats are accepted)."""
    arr = _labels_1d(y, name, n)
    integral = arr.dtype.kind == "f" and bool(np.isfinite(arr).all() and (arr == np.round(arr)).all())
    if arr.dtype.kind in "iu" or integral:
        idx = arr.astype(np.int64)
    else:
        raise ValueError(f"{name} must be integer class indices in [0, {k}), got dtype {arr.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= k):
        bad = idx[(idx < 0) | (idx >= k)]
        raise ValueError(
            f"{name} must be class indices in [0, {k}) (k = head rows), got {bad.size} outside, e.g. {int(bad[0])}"
        )
    return idx


def _seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _l2_rows(x: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm; a zero row stays zero."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def _algorithms(algorithms) -> tuple[str, ...]:
    if isinstance(algorithms, str):
        raise ValueError(
            f"algorithms must be a sequence of names, got the string {algorithms!r}; "  # noqa: TRY004
            f"pass ({algorithms!r},)"
        )
    algs = tuple(algorithms)
    if not algs:
        raise ValueError(f"algorithms must name at least one of {ALGORITHMS}, got none")
    for a in algs:
        if a not in ALGORITHMS:
            raise ValueError(f"algorithms: unknown algorithm {a!r}; valid: {ALGORITHMS}")
    if len(set(algs)) != len(algs):
        raise ValueError(f"algorithms must not repeat a name, got {algs}")
    return algs


# -- clustering agreement --------------------------------------------------------------------------


def _label_codes(labels_true, labels_pred) -> tuple[np.ndarray, np.ndarray]:
    """Both labelings as int64 codes (see `_encode`), after checking they are 1-D and of one length."""
    t = _labels_1d(labels_true, "labels_true")
    p = _labels_1d(labels_pred, "labels_pred")
    if t.shape[0] != p.shape[0]:
        raise ValueError(f"labels_true and labels_pred must have the same length, got {t.shape[0]} and {p.shape[0]}")
    return _encode(t, "labels_true")[1], _encode(p, "labels_pred")[1]


def nmi(labels_true, labels_pred) -> float:
    """Normalised mutual information, arithmetic-mean normalisation: MI / ((H(true) + H(pred)) / 2),
    natural logs: sklearn.metrics.normalized_mutual_info_score with default arguments, on the label
    codes. Both labelings with a single cluster (or no rows) -> 1.0; MI == 0 otherwise -> 0.0."""
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(*_label_codes(labels_true, labels_pred)))


def ari(labels_true, labels_pred) -> float:
    """Adjusted Rand index (Hubert & Arabie): sklearn.metrics.adjusted_rand_score on the label codes.
    Identical partitions (incl. no rows, one cluster each side, all singletons each side) -> 1.0;
    can be negative, 0 in expectation at random."""
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(*_label_codes(labels_true, labels_pred)))


# -- head ------------------------------------------------------------------------------------------


def head_accuracy(features, weight, bias, labels) -> float:
    """Fraction of rows with argmax(features @ weight.T + bias) == labels (ties: the lowest index).

    features (n, d) raw (never normalised: that is how the head was trained); weight (k, d); bias
    (k,); labels (n,) integer class indices in [0, k). Computed in float64.
    """
    x = _features(features, "features")
    w = _features(weight, "weight")
    n, d = x.shape
    k = w.shape[0]
    if w.shape[1] != d:
        raise ValueError(f"weight must have shape (k, {d}) to match features (n, {d}), got {w.shape}")
    b = np.asarray(bias)
    if b.dtype.kind not in "biuf" or b.shape != (k,):
        raise ValueError(
            f"bias must be a numeric array of shape ({k},) to match weight {w.shape}, "
            f"got shape {b.shape} dtype {b.dtype}"
        )
    b = b.astype(np.float64)
    bad = int(np.count_nonzero(~np.isfinite(b)))
    if bad:
        raise ValueError(f"bias has {bad} non-finite values (NaN or inf); it must be finite")
    y = _class_indices(labels, "labels", n, k)
    pred = np.argmax(x @ w.T + b, axis=1)
    return float(np.mean(pred == y))


# -- probe -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A logistic-regression probe fitted on training rows only.

    model: sklearn LogisticRegression (lbfgs, L2 with strength 1/C; the multinomial loss, which for
    two classes sklearn fits as the equivalent binomial loss with one weight vector) fitted on the
    standardised training features with targets = indices into `classes`; scaler: the
    StandardScaler fitted on the same (optionally L2-normalised) training rows; classes: the
    training label values (sorted unique, see the module docstring); normalize: whether rows are
    L2-normalised before the scaler; n_features: d.
    """

    model: Any
    scaler: Any
    classes: np.ndarray
    normalize: bool
    n_features: int

    def transform(self, x) -> np.ndarray:
        """The probe's input space: (L2-normalised) rows, standardised by the training scaler."""
        arr = _features(x, "x")
        if arr.shape[1] != self.n_features:
            raise ValueError(f"x must have {self.n_features} features (as in training), got shape {arr.shape}")
        if self.normalize:
            arr = _l2_rows(arr)
        return self.scaler.transform(arr)

    def predict(self, x) -> np.ndarray:
        """Predicted label values (elements of `classes`) for the rows of x."""
        return self.classes[self.model.predict(self.transform(x))]

    def accuracy(self, x, y) -> float:
        """Fraction of rows whose predicted label equals y (a label never seen in training counts as
        wrong)."""
        pred = self.predict(x)
        yy = _labels_1d(y, "y", pred.shape[0])
        return float(np.mean(pred == yy))


def fit_probe(train_x, train_y, *, C: float = 1.0, normalize: bool = True, seed: int = 0) -> Probe:
    """Fit the probe on the training rows: optional L2 row normalisation, a StandardScaler and a
    multinomial LogisticRegression(C, lbfgs), both fitted on these rows alone."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x = _features(train_x, "train_x")
    y = _labels_1d(train_y, "train_y", x.shape[0])
    if not (isinstance(C, (int, float, np.number)) and not isinstance(C, bool) and np.isfinite(C) and C > 0):
        raise ValueError(f"C must be a finite positive number (inverse regularisation), got {C!r}")
    seed = _seed(seed)
    classes, codes = _encode(y, "train_y")
    if classes.size < 2:
        raise ValueError(
            f"train_y must hold at least 2 distinct classes to fit a probe, got {classes.size} ({classes.tolist()!r})"
        )
    if normalize:
        x = _l2_rows(x)
    scaler = StandardScaler().fit(x)
    model = LogisticRegression(C=float(C), solver="lbfgs", max_iter=PROBE_MAX_ITER, random_state=seed)
    model.fit(scaler.transform(x), codes)
    return Probe(model=model, scaler=scaler, classes=classes, normalize=bool(normalize), n_features=x.shape[1])


def probe_accuracy(train_x, train_y, test_x, test_y, *, C: float = 1.0, normalize: bool = True, seed: int = 0) -> float:
    """Accuracy on (test_x, test_y) of the probe fitted on (train_x, train_y) alone."""
    trx = _features(train_x, "train_x")
    tx = _features(test_x, "test_x")
    if tx.shape[1] != trx.shape[1]:
        raise ValueError(f"test_x must have {trx.shape[1]} features like train_x, got shape {tx.shape}")
    ty = _labels_1d(test_y, "test_y", tx.shape[0])
    probe = fit_probe(trx, train_y, C=C, normalize=normalize, seed=seed)
    return probe.accuracy(tx, ty)


# -- separability ----------------------------------------------------------------------------------


def _first_appearance(labels: np.ndarray) -> np.ndarray:
    """Relabel cluster ids 0, 1, ... in order of first appearance (a canonical form)."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse.reshape(-1)].astype(np.int64)


def cluster(x, k: int, algorithm: str = "kmeans", *, normalize: bool = True, seed: int = 0) -> np.ndarray:
    """Cluster the rows of x into k clusters; returns int64 ids in [0, k), renumbered by first
    appearance. k must be in [2, n]; k == 1 returns all zeros and k == n returns 0..n-1 (the only
    partitions into 1 and n clusters) without running the algorithm.

    kmeans: KMeans(n_init=10, random_state=seed). agglomerative: Ward linkage. spectral:
    SpectralClustering on a nearest-neighbours graph (n_neighbors = min(10, n - 1)),
    assign_labels="cluster_qr" (deterministic), random_state=seed.
    """
    arr = _features(x, "x")
    n = arr.shape[0]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [2, n={n}] (or 1 for a single cluster), got {k!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: unknown algorithm {algorithm!r}; valid: {ALGORITHMS}")
    seed = _seed(seed)
    k = int(k)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    if k == n:
        return np.arange(n, dtype=np.int64)  # the only partition of n rows into n clusters
    if normalize:
        arr = _l2_rows(arr)
    if algorithm == "kmeans":
        from sklearn.cluster import KMeans

        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(arr)
    elif algorithm == "agglomerative":
        from sklearn.cluster import AgglomerativeClustering

        labels = AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(arr)
    else:
        from sklearn.cluster import SpectralClustering

        with warnings.catch_warnings():
            # separated classes give a disconnected neighbour graph: that is the good case here
            warnings.filterwarnings("ignore", message="Graph is not fully connected")
            # raised whenever n == d; the affinity is built from the features as intended
            warnings.filterwarnings("ignore", message="The spectral clustering API has changed")
            labels = SpectralClustering(
                n_clusters=k,
                affinity="nearest_neighbors",
                n_neighbors=min(10, n - 1),
                assign_labels="cluster_qr",
                random_state=seed,
            ).fit_predict(arr)
    return _first_appearance(np.asarray(labels))


def separability(
    x, labels, algorithms: Sequence[str] = ("kmeans", "agglomerative"), *, normalize: bool = True, seed: int = 0
) -> dict[str, dict[str, float]]:
    """{algorithm: {"nmi": ..., "ari": ...}}: each algorithm clusters x into k = number of distinct
    labels clusters, scored against the labels. A single label gives k = 1 and scores 1.0 (the
    sklearn convention for two one-cluster labelings)."""
    arr = _features(x, "x")
    y = _labels_1d(labels, "labels", arr.shape[0])
    algs = _algorithms(algorithms)
    classes, codes = _encode(y, "labels")
    k = int(classes.size)
    out: dict[str, dict[str, float]] = {}
    for alg in algs:
        pred = cluster(arr, k, alg, normalize=normalize, seed=seed)
        out[alg] = {"nmi": nmi(codes, pred), "ari": ari(codes, pred)}
    return out


# -- all three -------------------------------------------------------------------------------------


def interface_scores(
    test_x,
    test_y,
    weight,
    bias,
    train_x,
    train_y,
    *,
    C: float = 1.0,
    algorithms: Sequence[str] = ("kmeans", "agglomerative"),
    normalize: bool = True,
    seed: int = 0,
) -> dict[str, float]:
    """The three interfaces for one (variant, task), flat:
    {"head": acc, "probe": acc, "<alg>_nmi": ..., "<alg>_ari": ...} for each algorithm, in that order.

    test_y / train_y: integer class indices in [0, k) of the head (weight (k, d), bias (k,)).
    """
    tx = _features(test_x, "test_x")
    trx = _features(train_x, "train_x")
    if trx.shape[1] != tx.shape[1]:
        raise ValueError(f"train_x must have {tx.shape[1]} features like test_x, got shape {trx.shape}")
    algs = _algorithms(algorithms)
    scores = {
        "head": head_accuracy(tx, weight, bias, test_y),
        "probe": probe_accuracy(trx, train_y, tx, test_y, C=C, normalize=normalize, seed=seed),
    }
    sep = separability(tx, test_y, algs, normalize=normalize, seed=seed)
    for alg in algs:
        scores[f"{alg}_nmi"] = sep[alg]["nmi"]
        scores[f"{alg}_ari"] = sep[alg]["ari"]
    return scores


def continual_by_interface(matrices: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per interface key (e.g. "head", "probe", "kmeans_nmi"), crucible.continual's summaries of its
    matrix R[j, i] (score on task i after arrival j): {"acc": float, "bwt": float, "curve": list}."""
    if not isinstance(matrices, Mapping) or not matrices:
        raise ValueError(f"matrices must be a non-empty mapping interface -> matrix, got {type(matrices).__name__}")
    return {
        key: {"acc": average_accuracy(R), "bwt": backward_transfer(R), "curve": accuracy_curve(R)}
        for key, R in matrices.items()
    }
