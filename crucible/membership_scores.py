"""Proxy membership scores s_j in [0, 1] for pooled items (the CC-MMD proxy; docs/methods.md, curate).

A scorer needs no calibration: CC-MMD's audit correction removes its bias. A better scorer only
lowers the variance. Scorers here take feature matrices (dense arrays or scipy sparse) and are
cross-fitted: an item's score comes from a model that never saw it.
"""

from __future__ import annotations

import numpy as np

from crucible.seeding import numpy_rng


def domain_classifier_scores(reference, pool, *, folds: int = 2, seed: int = 0, C: float = 1.0) -> np.ndarray:
    """Cross-fitted probability that a pooled item comes from the reference distribution.

    A logistic regression separates reference (class 1) from pool (class 0), with balanced class
    weights so the odds estimate the density ratio p(x) / r(x) up to a constant. Pool items are
    split into `folds`; each fold is scored by a model fitted on the reference and the other folds.
    Target items look like the reference (high score); contaminants do not (low score).

    reference: (m, d), pool: (n, d) features. Returns (n,) scores in [0, 1].
    """
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression

    n = pool.shape[0]
    if folds < 2:
        raise ValueError(f"folds must be >= 2 for cross-fitting, got {folds}")
    if n < folds:
        raise ValueError(f"pool has {n} items, fewer than folds={folds}")
    stack = sparse.vstack if sparse.issparse(pool) else np.vstack
    fold_of = numpy_rng(seed).permutation(n) % folds
    scores = np.empty(n)
    for f in range(folds):
        train = fold_of != f
        x = stack([reference, pool[np.flatnonzero(train)]])
        y = np.r_[np.ones(reference.shape[0]), np.zeros(int(train.sum()))]
        model = LogisticRegression(C=C, class_weight="balanced", max_iter=2000)
        model.fit(x, y)
        scores[~train] = model.predict_proba(pool[np.flatnonzero(~train)])[:, 1]
    return scores


def knn_density_ratio_scores(reference: np.ndarray, pool: np.ndarray, *, k: int = 10) -> np.ndarray:
    """Share of reference points among an item's k nearest neighbours in reference + pool (cosine),
    rescaled by the sample sizes to a density-ratio odds and mapped to [0, 1].

    The item itself is excluded from its own neighbours. reference: (m, d), pool: (n, d).
    """
    m, n = reference.shape[0], pool.shape[0]
    if k < 1 or k >= m + n - 1:
        raise ValueError(f"k must be in [1, {m + n - 2}], got {k}")
    ref = reference / np.linalg.norm(reference, axis=1, keepdims=True).clip(1e-12)
    pl = pool / np.linalg.norm(pool, axis=1, keepdims=True).clip(1e-12)
    every = np.vstack([ref, pl])
    is_ref = np.r_[np.ones(m, bool), np.zeros(n, bool)]
    frac = np.empty(n)
    for start in range(0, n, 1024):
        sim = pl[start : start + 1024] @ every.T
        rows = np.arange(sim.shape[0])
        sim[rows, m + start + rows] = -np.inf
        nn = np.argpartition(-sim, k, axis=1)[:, :k]
        frac[start : start + 1024] = is_ref[nn].mean(axis=1)
    # neighbours are drawn from m reference and n-1 pool points: odds of a reference neighbour,
    # rescaled by (n-1)/m, estimate p(x)/r(x); the score maps the ratio r to r / (1 + r).
    ratio = (frac + 0.5 / k) / (1 - frac + 0.5 / k) * (n - 1) / m
    return ratio / (1.0 + ratio)
