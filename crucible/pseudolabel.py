"""Pseudo-labels for the curated pool, with design-corrected quality estimates (docs/methods.md, pseudolabel).

A teacher labels every pooled item: a logistic-regression probe on frozen embeddings of the
reference (`fit_teacher`), or any model whose raw logits the caller computes (a fine-tuned network,
a larger model's probe: `predict_logits`). The teacher is fitted on the reference's training rows
and never sees its dev rows (`dev_split`), on which its probabilities are calibrated by temperature
scaling (Guo et al. 2017, "On Calibration of Modern Neural Networks"): one scalar T > 0 minimising
the negative log-likelihood of softmax(logits / T) (`calibrate`). A probe fitted on a few hundred
items of an embedding with hundreds of dimensions separates them and is over-confident; T > 1
softens it, which matters because the confidence is used three times below: to select, as a
training weight, and as the proxy for "the pseudo-label is right" in the design-corrected estimates.

Selection keeps an item by confidence alone: the most confident items whose calibrated expected
accuracy reaches a target (`select_by_target`), a threshold, or the `quota` most confident items per
predicted class (so that a majority class does not swamp the rest). It never looks at the audit, so
the selected set is fixed over audit draws and the estimates below stay design-unbiased, and the
audit checks what the calibration promised.

Estimates (Poisson audit, I_j ~ Bernoulli(pi_j); crucible.design.ratio_estimate with its
delta-method interval). With s_j the proxy membership score (curate), M_j the membership and y_j the
true label revealed by the audit, c_j = 1[pseudo-label_j = y_j], conf_j the calibrated confidence and
p_jk the calibrated probability of class k:
    accuracy on the clean pool   sum M_j c_j / sum M_j            proxy s_j conf_j / s_j
    accuracy on the selection    sum S_j M_j c_j / sum S_j M_j    proxy S_j s_j conf_j / S_j s_j
    clean pool's class prior     sum M_j 1[y_j = k] / sum M_j     proxy s_j p_jk / s_j
Numerators and denominators are each design-unbiased totals (the difference estimator); the ratios
are consistent, with a normal interval from the delta method.

Training weights: see `training_weights`. Audited members keep their true labels.

Pure numpy / scipy / scikit-learn: arrays in, arrays and dataclasses out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax

from crucible.design import RatioEstimate, ratio_estimate
from crucible.seeding import numpy_rng

__all__ = [
    "Teacher",
    "Calibration",
    "Predictions",
    "QualityEstimates",
    "calibrate",
    "dev_split",
    "fit_teacher",
    "fit_temperature",
    "nll",
    "predict",
    "predict_logits",
    "label_indices",
    "select_by_threshold",
    "select_by_quota",
    "select_by_target",
    "select",
    "training_weights",
    "final_labels",
    "estimate_quality",
    "true_quality",
]


@dataclass(frozen=True)
class Teacher:
    """A linear probe with a temperature: logits = x W^T + b, probabilities softmax(logits / T).

    classes: the K class labels (sorted), coef: (K, d), intercept: (K,). A binary probe is stored with
    K = 2 rows (the first all zero), so softmax reproduces the logistic sigmoid exactly.
    calibration: the temperature's fit on the dev rows (`calibrate`).
    """

    classes: tuple[str, ...]
    coef: np.ndarray
    intercept: np.ndarray
    temperature: float
    calibration: Calibration | None = None
    C: float = float("nan")
    n_fit: int = 0

    def logits(self, x) -> np.ndarray:
        """(n, K) raw logits (before the temperature) of features x: (n, d)."""
        return np.asarray(x, dtype=np.float64) @ self.coef.T + self.intercept

    def proba(self, x) -> np.ndarray:
        """(n, K) calibrated class probabilities."""
        return softmax(self.logits(x) / self.temperature, axis=1)


@dataclass(frozen=True)
class Predictions:
    """label: (n,) index into the teacher's classes; confidence: (n,) its calibrated probability;
    proba: (n, K) all calibrated probabilities."""

    label: np.ndarray
    confidence: np.ndarray
    proba: np.ndarray


@dataclass(frozen=True)
class Calibration:
    """Temperature scaling fitted on the dev rows: the temperature, the dev NLL before and after, the
    dev accuracy (which the temperature does not change) and the number of dev rows."""

    temperature: float
    dev_nll_uncalibrated: float
    dev_nll: float
    dev_accuracy: float
    n_dev: int

    def to_dict(self) -> dict[str, float]:
        return {
            "temperature": self.temperature,
            "dev_nll_uncalibrated": self.dev_nll_uncalibrated,
            "dev_nll": self.dev_nll,
            "dev_accuracy": self.dev_accuracy,
            "n_dev": self.n_dev,
        }


def nll(logits, y, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of labels y (n,) under softmax(logits / temperature), logits (n, K)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    y = np.asarray(y, dtype=np.int64)
    return float(-log_softmax(z, axis=1)[np.arange(len(y)), y].mean())


def fit_temperature(logits, y, *, bounds: tuple[float, float] = (0.05, 20.0)) -> float:
    """The temperature T in `bounds` minimising nll(logits, y, T) (temperature scaling).

    The NLL is convex in beta = 1/T (logits / T is linear in beta and log-sum-exp is convex), so a
    bounded scalar search over beta finds the global minimum. logits: (n, K), y: (n,) class indices.
    Raises ValueError on an empty or mismatched input.
    """
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    if z.ndim != 2 or len(z) == 0 or len(y) != len(z):
        raise ValueError(f"fit_temperature: expected logits (n, K) with n > 0 and y (n,), got {z.shape} and {y.shape}")
    lo, hi = bounds
    res = minimize_scalar(
        lambda beta: nll(z, y, 1.0 / beta), bounds=(1.0 / hi, 1.0 / lo), method="bounded", options={"xatol": 1e-6}
    )
    return float(1.0 / res.x)


def calibrate(dev_logits, dev_y) -> Calibration:
    """Temperature scaling of any teacher's raw logits (a probe's, a fine-tuned network's) on the dev
    rows: dev_logits (n, K), dev_y (n,) class indices."""
    z, y = np.asarray(dev_logits, dtype=np.float64), np.asarray(dev_y, dtype=np.int64)
    temperature = fit_temperature(z, y)
    return Calibration(
        temperature=temperature,
        dev_nll_uncalibrated=nll(z, y, 1.0),
        dev_nll=nll(z, y, temperature),
        dev_accuracy=float((z.argmax(1) == y).mean()),
        n_dev=len(y),
    )


def dev_split(y, fraction: float, seed: int) -> np.ndarray:
    """The dev rows of a labeled sample: a boolean mask, stratified and seeded. Each class with >= 2
    rows gives round(fraction x its rows) of them (at least one) and keeps at least one for training.
    Every stage that chooses something on dev data (the teacher's temperature, the fine-tune's
    report, the head refit) uses these rows and never trains on them."""
    if not 0 < fraction < 1:
        raise ValueError(
            f"dev fraction: {fraction!r}; valid values are in (0, 1) (the share of the labeled rows held out as dev)"
        )
    y = np.asarray(y)
    rng = numpy_rng(seed)
    dev = np.zeros(len(y), dtype=bool)
    for k in sorted(set(y.tolist())):
        rows = np.flatnonzero(y == k)
        if len(rows) < 2:
            continue
        n_dev = min(max(int(round(fraction * len(rows))), 1), len(rows) - 1)
        dev[rng.permutation(rows)[:n_dev]] = True
    return dev


def _task_classes(labels: np.ndarray, classes, source: str) -> tuple[tuple, np.ndarray]:
    present = sorted(set(labels.tolist()))
    if len(present) < 2:
        only = present[0] if present else None
        raise ValueError(
            f"{source}, column 'label': all {len(labels)} rows have the single class {only!r}; "
            "expected labeled rows of at least two classes (a teacher is a classifier)"
        )
    classes = tuple(present) if classes is None else tuple(classes)
    return classes, label_indices(labels, classes, source=source)


def fit_teacher(
    x, labels, *, dev, classes=None, C: float | None = None, seed: int = 0, source: str = "reference"
) -> Teacher:
    """Fit the probe on the training rows of (x, labels) (those not in `dev`) and its temperature on
    the dev rows.

    x: (m, d) frozen embeddings of the reference; labels: (m,) class labels (strings); dev: (m,)
    boolean mask (`dev_split`). C: the probe's inverse L2 strength, None = chosen by cross-validation
    on the training rows (crucible.heads). classes: the task's classes (default: those in `labels`,
    sorted). Raises ValueError when the reference holds fewer than two classes, when a label is
    outside `classes`, or when there are no dev rows.
    """
    from crucible.heads import C_GRID, fit_linear_head

    x = np.asarray(x, dtype=np.float64)
    labels = np.asarray(labels, dtype=object)
    classes, y = _task_classes(labels, classes, source)
    dev = np.asarray(dev, dtype=bool)
    if dev.shape != y.shape or not dev.any() or dev.all():
        raise ValueError(
            f"{source}: the dev mask must mark some but not all of the {len(y)} rows "
            f"(got {int(dev.sum())}); no class has two rows to hold one out"
        )
    head = fit_linear_head(x[~dev], y[~dev], len(classes), Cs=(C,) if C else C_GRID, seed=seed)
    coef, intercept = head.weight.astype(np.float64), head.bias.astype(np.float64)
    cal = calibrate(x[dev] @ coef.T + intercept, y[dev])
    return Teacher(classes, coef, intercept, cal.temperature, cal, head.C, int((~dev).sum()))


def predict_logits(logits, temperature: float) -> Predictions:
    """Pseudo-labels from any teacher's raw logits (n, K) and its temperature: the most probable
    class, its calibrated probability, and all of them."""
    proba = softmax(np.asarray(logits, dtype=np.float64) / temperature, axis=1)
    label = proba.argmax(axis=1)
    return Predictions(label=label, confidence=proba[np.arange(len(label)), label], proba=proba)


def predict(teacher: Teacher, x) -> Predictions:
    """Pseudo-labels of x: (n, d) by a probe teacher."""
    return predict_logits(teacher.logits(x), teacher.temperature)


def label_indices(labels, classes, *, source: str = "labels") -> np.ndarray:
    """Indices of `labels` in `classes`; null labels map to -1. Raises ValueError naming the first
    label outside the classes, its row and the valid classes."""
    index = {c: i for i, c in enumerate(classes)}
    out = np.full(len(labels), -1, dtype=np.int64)
    for row, lab in enumerate(labels):
        if pd.isna(lab):
            continue
        if lab not in index:
            raise ValueError(
                f"{source}: row {row} has label {lab!r}, which is not one of the task's classes "
                f"{list(classes)} (the reference's labels)"
            )
        out[row] = index[lab]
    return out


def select_by_threshold(confidence, threshold: float) -> np.ndarray:
    """Items whose calibrated confidence is >= threshold. Returns a boolean mask (n,)."""
    return np.asarray(confidence, dtype=np.float64) >= threshold


def select_by_quota(label, confidence, quota: int, *, threshold: float = 0.0) -> np.ndarray:
    """At most `quota` items per predicted class: the most confident ones (ties by position), among
    those with confidence >= threshold. Returns a boolean mask (n,)."""
    if quota < 1:
        raise ValueError(f"quota: {quota!r}; valid values are integers >= 1 (items per predicted class)")
    label = np.asarray(label)
    conf = np.asarray(confidence, dtype=np.float64)
    keep = np.zeros(len(label), dtype=bool)
    for k in np.unique(label):
        rows = np.flatnonzero((label == k) & (conf >= threshold))
        order = rows[np.lexsort((rows, -conf[rows]))]  # by confidence, descending; stable by position
        keep[order[:quota]] = True
    return keep


def select_by_target(confidence, target: float) -> np.ndarray:
    """The most confident items whose mean calibrated confidence, their expected accuracy under a
    calibrated teacher, is >= target: the longest prefix of the items sorted by confidence (descending)
    whose running mean is >= target, and every item tied with its last. Nothing when even the most
    confident item is below target. Returns a boolean mask (n,)."""
    if not 0 < target <= 1:
        raise ValueError(f"target_accuracy: {target!r}; valid values are in (0, 1]")
    conf = np.asarray(confidence, dtype=np.float64)
    order = np.argsort(-conf, kind="stable")
    running = np.cumsum(conf[order]) / np.arange(1, len(conf) + 1)
    ok = np.flatnonzero(running >= target - 1e-12)
    if len(ok) == 0:
        return np.zeros(len(conf), dtype=bool)
    return conf >= conf[order[ok[-1]]]


def select(
    pred: Predictions, *, mode: str, threshold: float, quota: int | None = None, target: float = 0.9
) -> np.ndarray:
    """Dispatch: mode "target" (the most confident items of expected accuracy >= target), "threshold"
    (confidence >= threshold) or "quota" (per-class top `quota` among those >= threshold). Raises
    ValueError for an unknown mode."""
    if mode == "target":
        return select_by_target(pred.confidence, target)
    if mode == "threshold":
        return select_by_threshold(pred.confidence, threshold)
    if mode == "quota":
        return select_by_quota(pred.label, pred.confidence, quota if quota is not None else 0, threshold=threshold)
    raise ValueError(f"selection mode {mode!r}; valid: 'target', 'threshold', 'quota'")


def training_weights(m, confidence, audited, member, *, w_max: float) -> np.ndarray:
    """Per-item training weight w_j = clip(m_j, 0, w_max) * q_j for pooled items.

    m: (n,) corrected membership m_j = s_j + (I_j / pi_j)(M_j - s_j) (curate; crucible.design).
    confidence: (n,) calibrated confidence of the pseudo-label. q_j = confidence_j for a pseudo-label
    (the teacher's probability that the label is right, so the weight is the expected contribution
    of a clean, correctly labeled item) and q_j = 1 for an audited member (its label is the truth).

    Treatment of m_j (docs/methods.md, pseudolabel): sum_j m_j loss_j is design-unbiased for the
    clean-only loss, but m_j is negative for an audited non-member (s_j - s_j / pi_j) and as large
    as 1 / pi_j for an audited member with a low score. Weights are clipped to [0, w_max]:
    - below 0: a negative weight would turn the loss into a reward for fitting a contaminant and
      makes the objective unbounded below. Audited non-members therefore get weight 0, i.e. they
      are dropped; their negative correction (which would offset the contaminants' mass s_j among
      unaudited items) is lost, a bias toward the pool's contaminated part of order sum over
      audited non-members of s_j (1 - pi_j) / pi_j.
    - above w_max: one audited member with a small pi would dominate a minibatch (variance ~ 1/pi^2).
      Clipping bounds the variance at the cost of a bias of sum_j (m_j - w_max)_+, small when few
      items exceed w_max. Audited members are the only items whose m_j exceeds 1, so they keep a
      design weight (their own item plus the share of the unaudited ones they stand for), capped.
    Unaudited items have m_j = s_j in [0, 1]: no clipping applies. Returns (n,) finite, >= 0.
    """
    if not w_max > 0:
        raise ValueError(f"w_max: {w_max!r}; valid values are > 0 (the cap on a training weight)")
    m = np.asarray(m, dtype=np.float64)
    conf = np.asarray(confidence, dtype=np.float64)
    aud = np.asarray(audited, dtype=bool)
    mem = np.where(aud, np.nan_to_num(np.asarray(member, dtype=np.float64)), 0.0)
    if not (np.all(np.isfinite(m)) and np.all(np.isfinite(conf))):
        raise ValueError("training_weights: m and confidence must be finite")
    q = np.where(aud & (mem == 1), 1.0, conf)
    return np.clip(m, 0.0, w_max) * q


def final_labels(pred_label, audited, member, audit_label) -> tuple[np.ndarray, np.ndarray]:
    """The label each pooled item trains with: the audit's true label for an audited member, the
    pseudo-label otherwise. All (n,); labels are class indices. Returns (label, from_audit) where
    from_audit marks the audited members. Raises ValueError for an audited member without a label."""
    aud = np.asarray(audited, dtype=bool)
    mem = np.where(aud, np.nan_to_num(np.asarray(member, dtype=np.float64)), 0.0)
    y = np.asarray(audit_label, dtype=np.int64)
    from_audit = aud & (mem == 1)
    if (from_audit & (y < 0)).any():
        raise ValueError(
            f"audit: the audited member at pool position {int(np.flatnonzero(from_audit & (y < 0))[0])} has no label"
        )
    return np.where(from_audit, y, np.asarray(pred_label, dtype=np.int64)), from_audit


@dataclass(frozen=True)
class QualityEstimates:
    """Design-corrected estimates: pseudo-label accuracy on the clean pool, on the selection, and the
    clean pool's class prior (one ratio per class, in the teacher's class order)."""

    accuracy: RatioEstimate
    selected_accuracy: RatioEstimate | None  # None: nothing was selected
    prior: dict[str, RatioEstimate]

    def to_dict(self) -> dict[str, float]:
        out = {}
        for name, est in (
            ("accuracy", self.accuracy),
            ("selected_accuracy", self.selected_accuracy),
            *((f"prior_{k}", v) for k, v in self.prior.items()),
        ):
            if est is None:
                continue
            for field in ("value", "se", "ci_low", "ci_high"):
                out[f"{name}_{field}" if field != "value" else name] = getattr(est, field)
        return out


def estimate_quality(
    pred: Predictions, classes, scores, audited, member, audit_label, pi, selected, *, level: float = 0.95
) -> QualityEstimates:
    """The estimates of the module docstring, with `level` intervals.

    pred: the teacher's predictions on the n pooled items; scores: (n,) proxy membership s_j;
    audited: (n,) I_j; member: (n,) M_j where audited (ignored elsewhere); audit_label: (n,) class
    index of the true label where audited and a member (ignored elsewhere; -1 = unknown); pi: (n,);
    selected: (n,) the selection mask (must not depend on the audit; empty: no selected_accuracy).
    Raises ValueError on an audited member without a label, or a non-positive estimated denominator.
    """
    s = np.asarray(scores, dtype=np.float64)
    aud = np.asarray(audited, dtype=bool)
    mem = np.where(aud, np.nan_to_num(np.asarray(member, dtype=np.float64)), 0.0)
    y = np.asarray(audit_label, dtype=np.int64)
    sel = np.asarray(selected, dtype=np.float64)
    missing = aud & (mem == 1) & (y < 0)
    if missing.any():
        raise ValueError(f"audit: the audited member at pool position {int(np.flatnonzero(missing)[0])} has no label")
    correct = (mem == 1) & (y == pred.label)
    conf = pred.confidence
    accuracy = ratio_estimate(s * conf, mem * correct, s, mem, aud, pi, level=level)
    selected_accuracy = (
        ratio_estimate(sel * s * conf, sel * mem * correct, sel * s, sel * mem, aud, pi, level=level)
        if sel.any()
        else None
    )
    prior = {
        c: ratio_estimate(s * pred.proba[:, k], mem * (y == k), s, mem, aud, pi, level=level)
        for k, c in enumerate(classes)
    }
    return QualityEstimates(accuracy, selected_accuracy, prior)


def true_quality(pred: Predictions, classes, member, true_label, selected) -> dict[str, float]:
    """The estimands themselves, where the truth covers the pool: member (n,) M_j, true_label (n,)
    class index (-1 for non-members). Keys match QualityEstimates.to_dict()'s point estimates."""
    mem = np.asarray(member, dtype=np.float64) == 1
    y = np.asarray(true_label, dtype=np.int64)
    sel = np.asarray(selected, dtype=bool)
    correct = mem & (y == pred.label)
    out = {
        "accuracy": float(correct.sum() / max(mem.sum(), 1)),
        "selected_accuracy": float(correct[sel].sum() / max((mem & sel).sum(), 1)),
    }
    for k, c in enumerate(classes):
        out[f"prior_{c}"] = float((mem & (y == k)).sum() / max(mem.sum(), 1))
    return out
