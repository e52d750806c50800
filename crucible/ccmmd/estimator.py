"""CC-MMD: contamination-corrected MMD^2 between a clean reference and an audited pool.

Method: docs/methods.md, curate. Reference X (m, d) from p; pool Y (n, d) from (1 - eps) q + eps z with
latent membership M_j; proxy scores s_j for all; a Poisson audit reveals M_j where I_j = 1. With the
corrected membership m_j = s_j + (I_j / pi_j)(M_j - s_j) and, for any weights w,

    A    = sum_{i != i'} k(x_i, x_i') / (m (m - 1))
    r_j  = sum_i k(x_i, y_j)                          B(w) = sum_j w_j r_j
    c_j  = sum_{l != j} w_l k(y_j, y_l)               C(w) = sum_j w_j c_j
    N(w) = sum_j w_j                                  D(w) = N^2 - sum_j w_j^2
    V(w) = A - 2 B / (m N) + C / D

CC-MMD is V(m), the oracle V(M), naive V(1), audit-only V(I M / pi). B, C, N, D are design-unbiased
for their oracle values (E[m_j m_l] = M_j M_l for j != l), so V(m) is consistent for the oracle.

Uncertainty (delta method over the audit): the gradient of V at m is, in closed form,

    g_j = -2 (r_j N - B) / (m N^2) + (2 c_j D - 2 C (N - m_j)) / D^2,

and since m_j - s_j = (I_j / pi_j)(M_j - s_j) with independent I_j, Var(sum_j g_j m_j) has the
Horvitz-Thompson estimate sum_j (1 - pi_j) / pi_j^2 I_j (M_j - s_j)^2 g_j^2. The interval is
V +- z se, for the oracle of this pool (the audit is the only randomness). All sums come from
``kernel_matvec`` (exact, blockwise) or ``rff_matvec`` (approximate): r is one pass of the pool against
the reference, and c for all four weight vectors is one pass of the pool against itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..design import _audited_truth, as_vector, corrected_membership, normal_quantile
from .kernels import GaussianKernel, check_features, kernel_matvec
from .rff import rff_matvec

__all__ = ["CCMMDResult", "cc_mmd", "mmd_terms"]


@dataclass(frozen=True)
class CCMMDResult:
    """CC-MMD^2 with its interval, the comparison estimators and the design summaries.

    value, se, ci_low, ci_high: CC-MMD^2 (squared kernel units), delta-method SE, interval at
    ``level``. naive: all pool items counted clean. audit_only: weights I_j M_j / pi_j (NaN when
    that normaliser is <= 0, e.g. a single audited member). oracle: with the true membership, or
    None. n_hat = sum m_j; eps_hat = 1 - n_hat / n. ess = n_hat^2 / sum m_j^2 (Kish effective size
    of the corrected weights); ess_audit_only likewise for the audit-only weights. weights: (n,)
    float64 corrected memberships m_j (may be negative or > 1: that is what makes them unbiased).
    """

    value: float
    se: float
    ci_low: float
    ci_high: float
    level: float
    naive: float
    audit_only: float
    oracle: float | None
    n_hat: float
    eps_hat: float
    ess: float
    ess_audit_only: float
    n_pool: int
    n_reference: int
    n_audited: int
    n_audited_members: int
    bandwidths: tuple[float, ...]
    method: str
    weights: torch.Tensor

    def to_dict(self) -> dict:
        """JSON-ready metrics (floats, ints, lists); the per-item weights are left out."""
        d = asdict(self)
        d.pop("weights")
        d["bandwidths"] = list(self.bandwidths)
        return d


def mmd_terms(
    a: float, r: torch.Tensor, kw: torch.Tensor, w: torch.Tensor, m_ref: int, name: str = "weights"
) -> tuple[float, torch.Tensor]:
    """V(w) and its gradient dV/dw (n,) from the precomputed A, r = K_yx 1 and kw = K_yy^off w.

    Raises ValueError when N(w) < 2 or D(w) = N^2 - sum w^2 <= 0 (fewer than two clean items: the
    U-statistic normaliser N (N - 1) has no estimate).
    """
    n_w = float(w.sum())
    d_w = n_w**2 - float((w * w).sum())
    if not (n_w >= 2 and d_w > 0):
        raise ValueError(
            f"{name}: the estimated clean count is {n_w:.4g} and the normaliser "
            f"N^2 - sum w^2 is {d_w:.4g}; CC-MMD needs at least two estimated clean "
            "items (audit more items, or check the scores)"
        )
    b = float((w * r).sum())
    c = float((w * kw).sum())
    value = a - 2.0 * b / (m_ref * n_w) + c / d_w
    grad = -2.0 * (r * n_w - b) / (m_ref * n_w**2) + (2.0 * kw * d_w - 2.0 * c * (n_w - w)) / d_w**2
    return value, grad


def cc_mmd(
    reference,
    pool,
    scores,
    audited,
    member,
    pi,
    *,
    kernel: GaussianKernel | None = None,
    truth=None,
    labels_reference=None,
    labels_pool=None,
    method: str = "exact",
    n_features: int = 2048,
    seed: int = 0,
    block_size: int | None = None,
    backend: str = "auto",
    level: float = 0.95,
) -> CCMMDResult:
    """Contamination-corrected MMD^2 between ``reference`` and the clean part of ``pool``.

    reference: (m, d) features of the clean reference, m >= 2. pool: (n, d). scores: (n,) proxy
    scores in [0, 1]. audited: (n,) in {0, 1}. member: (n,) in {0, 1} where audited (ignored
    elsewhere). pi: (n,) inclusion probabilities in (0, 1]. kernel: GaussianKernel (default: the
    median heuristic on the pooled samples). truth: optional (n,) true membership for the oracle.
    labels_reference, labels_pool: integer labels for the supervised product kernel.
    method: "exact" (blockwise sums) or "rff" (random Fourier features with ``n_features`` per
    bandwidth, seeded). backend: "auto" | "torch" | "triton" for the exact sums.
    Raises ValueError on non-finite features, mismatched shapes, scores outside [0, 1], pi outside
    (0, 1], member not in {0, 1} on the audit, an audit with no members, or fewer than two
    estimated clean items.
    """
    x = check_features("reference", reference)
    y = check_features("pool", pool, x.shape[1])
    m_ref, n = x.shape[0], y.shape[0]
    if m_ref < 2:
        raise ValueError(f"reference: {m_ref} item(s); the within-reference U-statistic needs >= 2")
    if method not in ("exact", "rff"):
        raise ValueError(f"method: {method!r}; valid values are 'exact' and 'rff'")
    z = normal_quantile(level)
    s = as_vector("scores", scores, n)
    mvec = corrected_membership(s, audited, member, pi)
    aud = as_vector("audited", audited, n)
    p = as_vector("pi", pi, n)
    mem = _audited_truth("member", member, aud, n)
    n_members = int(((aud == 1) & (mem == 1)).sum())
    if n_members == 0:
        raise ValueError(
            f"member: the audit of {int(aud.sum())} item(s) found no members; the "
            "residual correction and the audit-only estimate need at least one"
        )
    cols = [mvec, torch.ones(n, dtype=torch.float64), aud * mem / p]
    if truth is not None:
        t = as_vector("truth", truth, n)
        bad = (t != 0) & (t != 1)
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"truth: index {i} is {t[i].item()}; valid values are 0 or 1")
        cols.append(t)
    w = torch.stack(cols, 1)

    hs = (kernel or GaussianKernel()).resolve(x, y)
    if method == "exact":

        def matvec(a, b, ww, **kw):
            return kernel_matvec(a, b, ww, hs, block_size=block_size, backend=backend, **kw)
    else:

        def matvec(a, b, ww, **kw):
            return rff_matvec(a, b, ww, hs, n_features=n_features, seed=seed, **kw)

    lab = {"labels_x": labels_reference} if labels_reference is not None else {}
    ones_m = torch.ones(m_ref, dtype=torch.float64)
    a_sum = float(matvec(x, None, ones_m, exclude_diagonal=True, **lab).sum()) / (m_ref * (m_ref - 1))
    cross = {} if labels_pool is None else {"labels_x": labels_pool, "labels_y": labels_reference}
    r = matvec(y, x, ones_m, **cross).cpu()
    within = {} if labels_pool is None else {"labels_x": labels_pool}
    kw = matvec(y, None, w.to(y.device), exclude_diagonal=True, **within).cpu()

    value, grad = mmd_terms(a_sum, r, kw[:, 0], mvec, m_ref, name="scores")
    naive, _ = mmd_terms(a_sum, r, kw[:, 1], cols[1], m_ref, name="pool")
    try:
        audit_only, _ = mmd_terms(a_sum, r, kw[:, 2], cols[2], m_ref, name="audit")
    except ValueError:
        audit_only = math.nan
    oracle = mmd_terms(a_sum, r, kw[:, 3], cols[3], m_ref, name="truth")[0] if truth is not None else None

    var = float(((1 - p) / p**2 * aud * (mem - s) ** 2 * grad**2).sum())
    se = math.sqrt(max(var, 0.0))
    n_hat = float(mvec.sum())
    wa = cols[2]
    return CCMMDResult(
        value=value,
        se=se,
        ci_low=value - z * se,
        ci_high=value + z * se,
        level=level,
        naive=naive,
        audit_only=audit_only,
        oracle=oracle,
        n_hat=n_hat,
        eps_hat=1.0 - n_hat / n,
        ess=n_hat**2 / float((mvec**2).sum()),
        ess_audit_only=float(wa.sum()) ** 2 / float((wa**2).sum()),
        n_pool=n,
        n_reference=m_ref,
        n_audited=int(aud.sum()),
        n_audited_members=n_members,
        bandwidths=tuple(hs),
        method=method,
        weights=mvec,
    )
