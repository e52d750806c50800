"""Survey-design estimators for an audited pool (CC-MMD; docs/methods.md, curate, reused by pseudolabel).

Every pool item j carries a proxy (a score, a confidence) known for all items, and a truth that an
audit reveals only where I_j = 1. The audit is a Poisson design: I_j ~ Bernoulli(pi_j) independently,
with pi_j in (0, 1] known. The difference estimator

    m_j = proxy_j + (I_j / pi_j) (truth_j - proxy_j)

is design-unbiased item by item (E[m_j] = truth_j) and, because the draws are independent,
E[m_j m_l] = truth_j truth_l for j != l. No calibration of the proxy is assumed: a poor proxy only
costs variance. With membership as the truth, m_j is the corrected membership of CC-MMD.

Arrays go in as anything ``numpy.asarray`` or ``torch.as_tensor`` accepts (numpy, lists, pandas
Series, tensors); values come out as float64 torch tensors on the input's device (CPU otherwise).
Bad inputs raise ``ValueError`` naming the argument, the first offending index and its value, and
saying what is valid.

Corrected weights can be negative (an audited non-member with a high score) or large (an audited
member with a low score and a small pi). That is what makes them unbiased; a caller that trains on
them decides the treatment (docs/methods.md, pseudolabel) and must say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import norm

__all__ = [
    "DifferenceEstimate",
    "RatioEstimate",
    "corrected_membership",
    "difference_estimate",
    "linear_design_variance",
    "ratio_estimate",
    "as_vector",
]


def as_vector(name: str, values, n: int | None = None) -> torch.Tensor:
    """Return ``values`` as a 1-D float64 tensor of length ``n``; raise ValueError otherwise.

    Non-finite entries are refused here, so every later check can assume finite numbers.
    """
    if isinstance(values, torch.Tensor):
        t = values.detach()
    else:
        arr = np.asarray(values)
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            raise ValueError(f"{name}: expected numbers, got an array of dtype {arr.dtype}")
        # a copy: pandas hands out read-only arrays, which torch refuses to wrap
        t = torch.from_numpy(np.array(arr, copy=True))
    if t.dtype == torch.bool:
        t = t.to(torch.float64)
    if t.is_complex() or not (
        t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    ):
        raise ValueError(f"{name}: expected real numbers, got dtype {t.dtype}")
    t = t.to(torch.float64)
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected length {n} (one entry per pool item), got {t.shape[0]}")
    bad = ~torch.isfinite(t)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}: index {i} is {t[i].item()}; values must be finite")
    return t


def _first_bad(name: str, t: torch.Tensor, bad: torch.Tensor, valid: str) -> None:
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}: index {i} is {t[i].item()!r}; valid values are {valid}")


def _check_design(audited, pi, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    aud = as_vector("audited", audited, n)
    _first_bad("audited", aud, (aud != 0) & (aud != 1), "0 or 1 (False/True)")
    p = as_vector("pi", pi, n)
    _first_bad("pi", p, (p <= 0) | (p > 1), "inclusion probabilities in (0, 1]")
    return aud, p


@dataclass(frozen=True)
class DifferenceEstimate:
    """Per-item corrected values m_j (shape (n,), float64) and their total sum_j m_j."""

    values: torch.Tensor
    total: float


def difference_estimate(proxy, audited, truth, pi) -> DifferenceEstimate:
    """Difference estimator m_j = proxy_j + (I_j / pi_j)(truth_j - proxy_j) under a Poisson audit.

    proxy, audited, truth, pi: length-n arrays. ``truth`` is read only where audited = 1; elsewhere it
    may hold anything, NaN included (it is unknown there). Raises ValueError on a shape mismatch,
    a non-finite proxy or audited truth, audited not in {0, 1}, or pi outside (0, 1].
    """
    s = as_vector("proxy", proxy)
    n = s.shape[0]
    aud, p = _check_design(audited, pi, n)
    t = _audited_truth("truth", truth, aud, n)
    values = s + aud / p * (t - s)
    return DifferenceEstimate(values=values, total=float(values.sum()))


def _audited_truth(name: str, truth, aud: torch.Tensor, n: int) -> torch.Tensor:
    # The truth is unknown off the audit, so NaN there is legitimate; only audited entries are checked.
    t = (
        torch.as_tensor(np.asarray(truth, dtype=np.float64))
        if not isinstance(truth, torch.Tensor)
        else truth.detach().to(torch.float64)
    )
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name}: expected a 1-D array of length {n}, got shape {tuple(t.shape)}")
    t = t.to(aud.device)
    bad = (aud == 1) & ~torch.isfinite(t)
    _first_bad(name, t, bad, "finite numbers where audited = 1")
    return torch.where(aud == 1, t, torch.zeros_like(t))


def corrected_membership(scores, audited, member, pi) -> torch.Tensor:
    """Corrected membership m_j = s_j + (I_j / pi_j)(M_j - s_j) of CC-MMD (docs/methods.md, curate).

    scores: (n,) proxy scores s_j in [0, 1] (no calibration assumed). audited: (n,) I_j in {0, 1}.
    member: (n,) M_j in {0, 1} where audited; ignored (any value, NaN too) elsewhere.
    pi: (n,) inclusion probabilities in (0, 1]. Returns (n,) float64.
    Raises ValueError naming the argument and first bad index for any violation of these ranges,
    a non-finite score, or a length mismatch.
    """
    s = as_vector("scores", scores)
    n = s.shape[0]
    _first_bad("scores", s, (s < 0) | (s > 1), "scores in [0, 1]")
    aud, p = _check_design(audited, pi, n)
    mem = _audited_truth("member", member, aud, n)
    _first_bad("member", mem, (aud == 1) & (mem != 0) & (mem != 1), "0 or 1 where audited = 1")
    return s + aud / p * (mem - s)


def linear_design_variance(g, proxy, audited, truth, pi) -> float:
    """Estimated design variance of sum_j g_j m_j, m the difference estimator, Poisson audit.

    Var = sum_j g_j^2 (truth_j - proxy_j)^2 (1 - pi_j) / pi_j is unknown off the audit; its
    Horvitz-Thompson estimate on the audited items is
        sum_j (1 - pi_j) / pi_j^2 * I_j * (truth_j - proxy_j)^2 * g_j^2,
    unbiased over audit draws for fixed g. With g the gradient of a smooth statistic of m, this is
    the delta-method variance (docs/methods.md, curate). Shapes: all (n,). Raises ValueError as above.
    """
    s = as_vector("proxy", proxy)
    n = s.shape[0]
    gg = as_vector("g", g, n)
    aud, p = _check_design(audited, pi, n)
    t = _audited_truth("truth", truth, aud, n)
    return float(((1 - p) / p**2 * aud * (t - s) ** 2 * gg.to(s.device) ** 2).sum())


@dataclass(frozen=True)
class RatioEstimate:
    """A ratio of two difference-estimated totals with a delta-method SE and a two-sided interval."""

    value: float
    se: float
    ci_low: float
    ci_high: float
    numerator: float
    denominator: float
    level: float

    def to_dict(self) -> dict:
        return {k: float(getattr(self, k)) for k in self.__dataclass_fields__}


def normal_quantile(level: float) -> float:
    """Two-sided standard-normal critical value for a ``level`` interval (1.96 at 0.95)."""
    if not 0 < level < 1:
        raise ValueError(f"level: {level!r}; valid values are in (0, 1), e.g. 0.95")
    return float(norm.ppf(0.5 + level / 2))


def ratio_estimate(
    numerator_proxy, numerator_truth, denominator_proxy, denominator_truth, audited, pi, *, level: float = 0.95
) -> RatioEstimate:
    """Ratio R = T_num / T_den of two difference-estimated totals, e.g. sum m_j y_j / sum m_j.

    Each total is estimated by ``difference_estimate`` with its own proxy and audited truth (for a
    clean-pool mean of a known y: numerator proxy s_j y_j, truth M_j y_j; denominator proxy s_j,
    truth M_j). Delta method: dR/dm_num_j = 1/T_den and dR/dm_den_j = -R/T_den, so R is linear in
    the audit through the residual e_j = (t_num - p_num)_j - R (t_den - p_den)_j, and
        Var(R) ~= sum_j (1 - pi_j) / pi_j^2 * I_j * e_j^2 / T_den^2.
    Interval: R +- z * se (normal, two-sided, ``level``). Raises ValueError on bad inputs or when
    the estimated denominator is <= 0 (the ratio is undefined).
    """
    z = normal_quantile(level)
    num = difference_estimate(numerator_proxy, audited, numerator_truth, pi)
    den = difference_estimate(denominator_proxy, audited, denominator_truth, pi)
    if num.values.shape != den.values.shape:
        raise ValueError(f"denominator_proxy: expected length {num.values.shape[0]}, got {den.values.shape[0]}")
    if den.total <= 0:
        raise ValueError(
            f"denominator_truth: the estimated denominator total is {den.total:.6g}; "
            "a ratio needs a positive total (audit more items or check the proxy)"
        )
    r = num.total / den.total
    aud, p = _check_design(audited, pi, num.values.shape[0])
    # m - proxy is exactly (I/pi)(truth - proxy), so the audited residuals come back out of m.
    res_num = (num.values - as_vector("numerator_proxy", numerator_proxy)) * p
    res_den = (den.values - as_vector("denominator_proxy", denominator_proxy)) * p
    e = res_num - r * res_den
    var = float(((1 - p) / p**2 * aud * e**2).sum()) / den.total**2
    se = math.sqrt(max(var, 0.0))
    return RatioEstimate(
        value=r, se=se, ci_low=r - z * se, ci_high=r + z * se, numerator=num.total, denominator=den.total, level=level
    )
