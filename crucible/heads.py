"""Linear heads and probes fitted on frozen features, their strength chosen by cross-validation
(docs/methods.md, value).

One fit serves three places:
- the baseline every result answers to: a logistic-regression probe on the frozen base model's
  features of the labeled rows (`fit_probe_cv`), what a user gets without post-training;
- LP-FT's first step (Kumar et al., ICLR 2022, "Fine-Tuning can Distort Pretrained Features"): the
  classification head starts as that probe, fitted on the raw pooled features the head sees
  (`fit_linear_head`), so fine-tuning starts from a good head and distorts the features less;
- the head refit after merging or quantizing: a task's head fitted again on the changed encoder's
  features of its labeled rows (`fit_linear_head`).

C (inverse L2 strength) is chosen from a grid by stratified k-fold cross-validation accuracy on the
training rows alone (ties: the smaller C, the stronger regularisation), then the model is refitted
on all of them. Pure numpy and scikit-learn; deterministic given `seed`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from crucible.evaluation import Probe, fit_probe

__all__ = ["C_GRID", "LinearHead", "ProbeFit", "choose_C", "fit_linear_head", "fit_probe_cv"]

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)
MAX_ITER = 5000


def _state(seed: int) -> int:
    """scikit-learn's random_state takes seeds below 2^32; crucible's stream seeds reach 2^63."""
    return int(seed) % 2**32


def _check(x, y, what: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    if x.ndim != 2 or len(x) == 0 or len(y) != len(x):
        raise ValueError(
            f"{what}: expected features (n, d) with n > 0 and one label per row, got {x.shape} and {y.shape}"
        )
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        raise ValueError(f"{what}: the features hold {bad} non-finite values (NaN or inf)")
    if len(np.unique(y)) < 2:
        raise ValueError(f"{what}: the labels hold a single class {np.unique(y).tolist()}; a classifier needs two")
    return x, y


def _folds(y: np.ndarray, folds: int) -> int:
    """As many folds as the rarest class allows (at most `folds`, at least 2); 0 when a class has a
    single row, so that no cross-validation is possible."""
    smallest = int(np.bincount(np.unique(y, return_inverse=True)[1].reshape(-1)).min())
    return 0 if smallest < 2 else min(folds, smallest)


def choose_C(x, y, fit_score, *, Cs=C_GRID, folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """(C, its mean cross-validated accuracy): the C of `Cs` whose models, fitted by
    `fit_score(x_train, y_train, x_val, y_val, C) -> accuracy` on k - 1 folds, score best on the held-out
    fold, on average over k stratified folds (shuffled with `seed`). Ties go to the smaller C. With a
    class of one row there is nothing to cross-validate: the middle of the grid, accuracy NaN."""
    from sklearn.model_selection import StratifiedKFold

    x, y = _check(x, y, "choose_C")
    Cs = sorted(float(c) for c in Cs)
    if not Cs or min(Cs) <= 0:
        raise ValueError(f"Cs: {Cs!r}; expected positive inverse regularisation strengths")
    k = _folds(y, folds)
    if k == 0:
        return Cs[len(Cs) // 2], float("nan")
    splits = list(StratifiedKFold(n_splits=k, shuffle=True, random_state=_state(seed)).split(x, y))
    scores = [np.mean([fit_score(x[tr], y[tr], x[va], y[va], C) for tr, va in splits]) for C in Cs]
    best = int(np.argmax(np.round(scores, 12)))  # argmax takes the first (smallest C) of ties
    return Cs[best], float(scores[best])


@dataclass(frozen=True)
class ProbeFit:
    """A probe (crucible.evaluation.Probe), the C chosen for it and that C's CV accuracy."""

    probe: Probe
    C: float
    cv_accuracy: float


def fit_probe_cv(train_x, train_y, *, Cs=C_GRID, folds: int = 5, normalize: bool = True, seed: int = 0) -> ProbeFit:
    """crucible.evaluation.fit_probe (L2-normalised rows, standardised, logistic regression) with C
    chosen by `choose_C`."""
    x, y = _check(train_x, train_y, "fit_probe_cv")

    def score(xt, yt, xv, yv, C):
        if len(np.unique(yt)) < 2:
            return float(np.mean(yv == yt[0]))
        return fit_probe(xt, yt, C=C, normalize=normalize, seed=_state(seed)).accuracy(xv, yv)

    C, cv = choose_C(x, y, score, Cs=Cs, folds=folds, seed=seed)
    return ProbeFit(fit_probe(x, y, C=C, normalize=normalize, seed=_state(seed)), C, cv)


@dataclass(frozen=True)
class LinearHead:
    """A head on raw features: logits = x @ weight.T + bias. weight (k, d) and bias (k,) float32 for
    the task's k classes; C and cv_accuracy: the regularisation chosen and its CV accuracy."""

    weight: np.ndarray
    bias: np.ndarray
    C: float
    cv_accuracy: float

    def predict(self, x) -> np.ndarray:
        return np.argmax(np.asarray(x, dtype=np.float64) @ self.weight.T + self.bias, axis=1)


def _fit_raw(x: np.ndarray, y: np.ndarray, n_classes: int, C: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logistic regression on centred x scaled by one number (the features' RMS deviation), folded
    back into (weight (K, d), bias (K,)) on raw x. One scale for every dimension, not one per
    dimension: a pooled transformer feature can be near constant, and dividing by its tiny sd would
    give it a huge weight that the first fine-tuning step turns into huge logits."""
    from sklearn.linear_model import LogisticRegression

    mu = x.mean(axis=0)
    sd = float(np.sqrt(np.mean((x - mu) ** 2))) or 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=FutureWarning)
        model = LogisticRegression(C=C, max_iter=MAX_ITER, random_state=_state(seed)).fit((x - mu) / sd, y)
    coef, intercept = np.atleast_2d(model.coef_), np.atleast_1d(model.intercept_)
    fitted = model.classes_.astype(np.int64)
    weight = np.zeros((n_classes, x.shape[1]))
    bias = np.full(n_classes, -1e3)  # a class absent from the rows is never predicted
    if len(fitted) == 2:  # sklearn keeps one row (the logit of the second class): split it symmetrically
        rows = np.stack([-coef[0] / 2, coef[0] / 2])
        icpt = np.array([-intercept[0] / 2, intercept[0] / 2])
    else:
        rows, icpt = coef, intercept
    weight[fitted] = rows / sd
    bias[fitted] = icpt - (rows / sd) @ mu
    return weight, bias


def fit_linear_head(x, y, n_classes: int, *, Cs=C_GRID, folds: int = 5, seed: int = 0) -> LinearHead:
    """A linear head on raw features x (n, d) for class indices y (n,) in [0, n_classes), C chosen by
    `choose_C`: the probe a task head starts from (LP-FT) or is refitted as after merging."""
    x, y = _check(x, y, "fit_linear_head")
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= n_classes:
        raise ValueError(
            f"fit_linear_head: labels must be class indices in [0, {n_classes}), got {sorted(set(y.tolist()))[:5]}"
        )

    def score(xt, yt, xv, yv, C):
        if len(np.unique(yt)) < 2:
            return float(np.mean(yv == yt[0]))
        w, b = _fit_raw(xt, yt, n_classes, C, seed)
        return float(np.mean(np.argmax(xv @ w.T + b, axis=1) == yv))

    C, cv = choose_C(x, y, score, Cs=Cs, folds=folds, seed=seed)
    weight, bias = _fit_raw(x, y, n_classes, C, seed)
    return LinearHead(weight.astype(np.float32), bias.astype(np.float32), C, cv)
