"""Paired comparisons of two classifiers scored on the same test rows (docs/methods.md, statistics).

Two models scored on one test set are compared by their per-row outcomes, never by two accuracies
side by side: the rows are shared, so most of the noise is shared too, and only the rows where the
two disagree carry evidence.

- Exact McNemar test: with b = rows A gets right and B wrong, c = the reverse, under H0 (equal
  accuracy) b ~ Binomial(b + c, 1/2), so p = min(1, 2 P(Binomial(b + c, 1/2) <= min(b, c))).
- Paired bootstrap: resample the row indices with replacement, recompute acc(A) - acc(B) on the same
  resampled rows, take the (1 - level) / 2 and (1 + level) / 2 percentiles of the B differences.
- Over tasks: the mean over tasks of each task's difference (every task counts once, whatever its
  size), its interval by a stratified bootstrap (resample within each task, independently).
- Normalised accuracy: mean over tasks of acc(A) / acc(B), by the same stratified bootstrap.

Outcomes are boolean arrays (n,), True where the model's prediction is right. Draws come from a
numpy Generator seeded by the caller, so an interval is a function of its inputs and seed.
Pure numpy and scipy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import binom

__all__ = [
    "Comparison",
    "compare_paired",
    "compare_tasks",
    "mcnemar_exact",
    "normalised_accuracy",
    "paired_bootstrap",
]

N_BOOT = 10_000


@dataclass(frozen=True)
class Comparison:
    """A paired comparison of model A against model B on the same rows.

    a, b: the two accuracies; diff = a - b with its `level` interval [ci_low, ci_high]; n rows;
    a_only / b_only: the discordant rows (A right and B wrong / the reverse); p_value: the exact
    McNemar p (None for a mean over tasks, where the interval is the evidence)."""

    a: float
    b: float
    diff: float
    ci_low: float
    ci_high: float
    level: float
    n: int
    a_only: int
    b_only: int
    p_value: float | None

    @property
    def significant(self) -> bool:
        """The interval excludes zero."""
        return self.ci_low > 0 or self.ci_high < 0

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _outcomes(a, b, what: str = "outcomes") -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(
            f"{what}: expected two 1-d arrays of the same length (one outcome per test row), "
            f"got shapes {a.shape} and {b.shape}"
        )
    if len(a) == 0:
        raise ValueError(f"{what}: no rows to compare")
    for name, x in (("A", a), ("B", b)):
        if x.dtype != bool and not np.isin(x, (0, 1)).all():
            raise ValueError(
                f"{what}: model {name}'s outcomes must be booleans (right / wrong), got values "
                f"{np.unique(x)[:5].tolist()}"
            )
    return a.astype(bool), b.astype(bool)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level: {level!r}; valid values are in (0, 1), e.g. 0.95")


def mcnemar_exact(a_correct, b_correct) -> tuple[int, int, float]:
    """(b, c, p): b rows where A is right and B wrong, c the reverse, and the exact two-sided McNemar
    p-value min(1, 2 P(Binomial(b + c, 1/2) <= min(b, c))); p = 1 when the models never disagree."""
    a, b = _outcomes(a_correct, b_correct)
    n01, n10 = int((a & ~b).sum()), int((~a & b).sum())
    n = n01 + n10
    p = 1.0 if n == 0 else min(1.0, 2.0 * float(binom.cdf(min(n01, n10), n, 0.5)))
    return n01, n10, p


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _resample(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n) row indices drawn with replacement."""
    return rng.integers(0, n, size=(n_boot, n))


def paired_bootstrap(
    a_correct, b_correct, *, level: float = 0.95, n_boot: int = N_BOOT, seed: int | np.random.Generator = 0
) -> tuple[float, float, float]:
    """(diff, ci_low, ci_high): acc(A) - acc(B) and its percentile interval from `n_boot` paired
    resamples of the rows."""
    _check_level(level)
    a, b = _outcomes(a_correct, b_correct)
    rng = np.random.default_rng(seed)
    d = a.astype(np.int8) - b.astype(np.int8)
    draws = d[_resample(len(d), n_boot, rng)].mean(axis=1)
    return float(d.mean()), *_percentiles(draws, level)


def compare_paired(
    a_correct, b_correct, *, level: float = 0.95, n_boot: int = N_BOOT, seed: int | np.random.Generator = 0
) -> Comparison:
    """Model A against model B on the same rows: both accuracies, the paired-bootstrap interval of the
    difference and the exact McNemar p-value."""
    a, b = _outcomes(a_correct, b_correct)
    diff, lo, hi = paired_bootstrap(a, b, level=level, n_boot=n_boot, seed=seed)
    n01, n10, p = mcnemar_exact(a, b)
    return Comparison(float(a.mean()), float(b.mean()), diff, lo, hi, level, len(a), n01, n10, p)


def _stratified(pairs: Mapping[str, tuple], stat, *, level: float, n_boot: int, seed) -> tuple[float, float, float]:
    """(value, ci_low, ci_high) of mean over tasks of stat(acc_A, acc_B), resampling within each task."""
    _check_level(level)
    if not pairs:
        raise ValueError("no tasks to compare")
    rng = np.random.default_rng(seed)
    point, draws = [], []
    for task, (a, b) in pairs.items():
        a, b = _outcomes(a, b, f"task {task!r}")
        idx = _resample(len(a), n_boot, rng)
        point.append(stat(a.mean(), b.mean()))
        draws.append(stat(a[idx].mean(axis=1), b[idx].mean(axis=1)))
    return float(np.mean(point)), *_percentiles(np.mean(draws, axis=0), level)


def compare_tasks(
    pairs: Mapping[str, tuple], *, level: float = 0.95, n_boot: int = N_BOOT, seed: int = 0
) -> dict[str, Comparison]:
    """Per task `compare_paired`, and under "mean" the mean over tasks of the accuracies and of the
    differences, its interval from a bootstrap stratified by task (p_value None). pairs: task ->
    (A's outcomes, B's outcomes) on that task's rows."""
    out = {}
    for i, (task, (a, b)) in enumerate(pairs.items()):
        a, b = _outcomes(a, b, f"task {task!r}")
        out[task] = compare_paired(a, b, level=level, n_boot=n_boot, seed=np.random.default_rng([seed, i]))
    diff, lo, hi = _stratified(pairs, lambda x, y: x - y, level=level, n_boot=n_boot, seed=seed)
    out["mean"] = Comparison(
        float(np.mean([c.a for c in out.values()])),
        float(np.mean([c.b for c in out.values()])),
        diff,
        lo,
        hi,
        level,
        sum(c.n for c in out.values()),
        sum(c.a_only for c in out.values()),
        sum(c.b_only for c in out.values()),
        None,
    )
    return out


def normalised_accuracy(
    pairs: Mapping[str, tuple], *, level: float = 0.95, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[float, float, float]:
    """(value, ci_low, ci_high) of mean over tasks of acc(A) / acc(B) (e.g. a merged model against each
    task's own fine-tune), its interval from the stratified bootstrap. A task where B scores 0 has no
    ratio: a ValueError names it."""
    for task, (_, b) in pairs.items():
        if not np.asarray(b).any():
            raise ValueError(f"task {task!r}: the reference model gets no row right, so acc(A) / acc(B) is undefined")
    return _stratified(pairs, lambda x, y: x / np.maximum(y, 1e-12), level=level, n_boot=n_boot, seed=seed)
