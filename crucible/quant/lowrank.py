"""Low-rank compensation of quantization error (docs/methods.md, quantize).

    stats = InputStats()
    for x in calibration_batches:           # (..., K) inputs of the layer y = x W^T
        stats.update(x)
    s = stats.scale("qera")                 # (K,) float64, floored, finite and > 0
    E = W - dequantize(quantize(W))         # (N, K) quantization error
    svd = factorize(E, s)                   # one float64 SVD of E diag(s)
    sigma = error_spectrum(svd)             # its singular values, for the allocation
    A, B = compensate(svd, rank)            # float32 (N, r), (r, K): E ~= A @ B
    y = x @ dequantize(Q).T + (x @ B.T) @ A.T

How many ranks each matrix gets under a total budget: crucible.quant.rank_allocation.

Method
- LQER (Zhang et al., "LQER: Low-Rank Quantization Error Reconstruction for LLMs", ICML 2024):
  keep a rank-r approximation of the quantization error E = W - dequant(Q(W)) as an adapter
  y += x (A B)^T, computed by the SVD of E scaled by a diagonal activation scale, then unscaled.
  LQER's scale: s_i = mean|x_i|, normalised by sqrt(min s * max s) (kind "lqer").
- QERA (Zhang et al., "QERA: an Analytical Framework for Quantization Error Reconstruction",
  ICLR 2025): the rank-r minimiser of E_x ||x (E - A B)^T||^2 is the truncated SVD of
  E (R_xx)^(1/2); under the diagonal approximation R_xx ~= diag(E[x_i^2]) this is the SVD of
  E diag(s) with s_i = sqrt(E[x_i^2]) ("QERA-approx", kind "qera"). With a diagonal scale,
  ||X (E - A B)^T||_F^2 = ||(E - A B) diag(s)||_F^2 * n exactly when X^T X = n diag(s^2), and the
  truncated SVD of E diag(s) then minimises it (Eckart-Young).

Contract
- InputStats.update(x): x a floating tensor (or array) of shape (..., K); accumulates, in float64,
  the per-feature sum |x_i|, sum x_i^2 and the number of rows. ValueError for a NaN/inf entry
  (naming how many), a K that differs from earlier batches, or a 0-d / non-float input.
- activation_scale(sum_abs, sum_sq, count, kind) -> (K,) float64, every entry finite and > 0.
  Dead or near-dead features are floored at SCALE_FLOOR (1e-6) times the largest raw scale (before
  LQER's normalisation), so the unscaling 1/s in B stays finite (at most 1e6 times 1/max s); if
  every feature is dead (max raw scale 0), s is all ones (then any uniform scale is equivalent to
  plain). ValueError for an unknown kind, count <= 0, NaN/inf or negative sums, or mismatched shapes.
- factorize(E, s=None) -> ErrorSVD (U (N, m), S (m,), Vh (m, K), s (K,) or None; float64,
  m = min(N, K), S non-increasing): the thin SVD of E diag(s). torch.linalg.svd in float64; if
  LAPACK fails to converge (torch.linalg.LinAlgError) it falls back to an eigendecomposition of the
  smaller Gram matrix (singular values then as column norms of the projected matrix).
  ValueError for a non-2-D or non-float E, NaN/inf in E, or an s that is not (K,), finite and > 0.
- error_spectrum(E or ErrorSVD, s=None) -> (m,) float64 singular values of E diag(s), non-increasing.
- compensate(E or ErrorSVD, rank, s=None) -> (A, B) float32 on E's device, A = U_r S_r (N, r),
  B = V_r^T diag(1/s) (r, K): E ~= A @ B. rank 0 gives (N, 0) and (0, K); rank m reconstructs E up
  to float rounding. ValueError for a rank that is not an int in [0, m], or an s passed together
  with an ErrorSVD (the factorisation already holds its scale).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

SCALE_FLOOR = 1e-6  # smallest activation scale, relative to the largest (raw, before normalisation)
KINDS = ("qera", "lqer", "plain")

__all__ = [
    "SCALE_FLOOR",
    "KINDS",
    "InputStats",
    "activation_scale",
    "ErrorSVD",
    "factorize",
    "error_spectrum",
    "compensate",
]


# --------------------------------------------------------------------------- activation scales


def _nonfinite_message(t: torch.Tensor, what: str) -> str | None:
    n_nan = int(torch.isnan(t).sum())
    n_inf = int(torch.isinf(t).sum())
    if n_nan or n_inf:
        return f"{what} holds {n_nan} NaN and {n_inf} inf entries"
    return None


def _as_vector(v, name: str) -> torch.Tensor:
    t = torch.as_tensor(v).detach()
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(t.shape)}")
    if not (t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise ValueError(f"{name} must be real numbers, got {t.dtype}")
    t = t.to(torch.float64)
    msg = _nonfinite_message(t, name)
    if msg:
        raise ValueError(msg)
    return t


def activation_scale(sum_abs, sum_sq, count: int, kind: str = "qera", floor: float = SCALE_FLOOR) -> torch.Tensor:
    """Per-input-feature scale s (K,) float64 from calibration sums over `count` rows.

    kind "qera": s_i = sqrt(sum_sq_i / count) (QERA-approx); "lqer": s_i = sum_abs_i / count, then
    divided by sqrt(min s * max s) (LQER); "plain": ones. Before LQER's normalisation every entry is
    floored at `floor` * max s (all ones if max s is 0), so s is finite and > 0 and 1/s finite.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not (isinstance(floor, numbers.Real) and 0 < floor <= 1):
        raise ValueError(f"floor must be in (0, 1], got {floor!r}")
    sum_abs = _as_vector(sum_abs, "sum_abs")
    sum_sq = _as_vector(sum_sq, "sum_sq")
    if sum_abs.shape != sum_sq.shape:
        raise ValueError(
            f"sum_abs and sum_sq must have the same shape, got {list(sum_abs.shape)} and {list(sum_sq.shape)}"
        )
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count <= 0:
        raise ValueError(f"count must be a positive int (rows of calibration data), got {count!r}")
    for name, t in (("sum_abs", sum_abs), ("sum_sq", sum_sq)):
        if bool((t < 0).any()):
            i = int(torch.nonzero(t < 0)[0, 0])
            raise ValueError(f"{name} must be >= 0, got {name}[{i}] = {float(t[i])}")
    if kind == "plain":
        return torch.ones_like(sum_abs)
    raw = torch.sqrt(sum_sq / count) if kind == "qera" else sum_abs / count
    if raw.numel() == 0:
        return raw
    top = float(raw.max())
    if not math.isfinite(top):  # sum_sq / count can overflow only for absurd inputs
        raise ValueError(f"the {kind} scale overflows float64 (max {top})")
    if top == 0.0:
        return torch.ones_like(raw)
    s = raw.clamp(min=floor * top)
    if kind == "lqer":
        s = s / math.sqrt(float(s.min()) * float(s.max()))
    return s


@dataclass
class InputStats:
    """Running per-input-feature sums over calibration batches of shape (..., K), in float64."""

    sum_abs: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None
    count: int = 0
    in_features: int | None = field(default=None)

    def update(self, x) -> "InputStats":
        x = torch.as_tensor(x).detach()
        if not x.is_floating_point():
            raise ValueError(f"InputStats.update expects a floating-point tensor, got {x.dtype}")
        if x.dim() == 0:
            raise ValueError("InputStats.update expects shape (..., K), got a 0-d tensor")
        k = x.shape[-1]
        if self.in_features is not None and k != self.in_features:
            raise ValueError(f"InputStats.update: last dimension {k} differs from earlier batches' {self.in_features}")
        msg = _nonfinite_message(x, "InputStats.update: the batch")
        if msg:
            raise ValueError(msg)
        rows = x.reshape(-1, k).to(torch.float64)
        if self.sum_abs is None:
            self.in_features = k
            self.sum_abs = torch.zeros(k, dtype=torch.float64, device=rows.device)
            self.sum_sq = torch.zeros(k, dtype=torch.float64, device=rows.device)
        rows = rows.to(self.sum_abs.device)
        self.sum_abs += rows.abs().sum(0)
        self.sum_sq += (rows * rows).sum(0)
        self.count += rows.shape[0]
        return self

    def scale(self, kind: str = "qera", floor: float = SCALE_FLOOR) -> torch.Tensor:
        """activation_scale of the accumulated sums; ValueError before any update."""
        if self.sum_abs is None or self.count == 0:
            raise ValueError("InputStats.scale: no calibration rows seen (call update first)")
        return activation_scale(self.sum_abs, self.sum_sq, self.count, kind, floor)


# --------------------------------------------------------------------------- SVD of the scaled error


@dataclass
class ErrorSVD:
    """Thin SVD of E diag(s): U (N, m), S (m,) non-increasing, Vh (m, K), float64; s (K,) or None."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor
    s: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def max_rank(self) -> int:
        return int(self.S.numel())


def _check_error(E) -> torch.Tensor:
    if not isinstance(E, torch.Tensor):
        E = torch.as_tensor(E)
    if E.dim() != 2:
        raise ValueError(f"E must be a 2-D (N, K) matrix, got shape {list(E.shape)}")
    if not E.is_floating_point():
        raise ValueError(f"E must be a floating-point tensor, got {E.dtype}")
    msg = _nonfinite_message(E, "E")
    if msg:
        raise ValueError(msg + " (a NaN block of the quantized weight? compensate only finite errors)")
    return E.detach()


def _check_scale(s, k: int, device) -> torch.Tensor:
    s = _as_vector(s, "s").to(device)
    if s.shape[0] != k:
        raise ValueError(f"s must have shape ({k},) to match E's {k} columns, got {list(s.shape)}")
    if bool((s <= 0).any()):
        i = int(torch.nonzero(s <= 0)[0, 0])
        raise ValueError(f"s must be > 0 (floor dead features, see activation_scale), got s[{i}] = {float(s[i])}")
    return s


def _gram_svd(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of M (float64) through the eigendecomposition of the smaller Gram matrix."""
    n, k = M.shape
    if n >= k:
        _, V = torch.linalg.eigh(M.T @ M)  # (k, k), ascending
        V = V.flip(-1)
        P = M @ V  # columns u_j sigma_j
        S = torch.linalg.vector_norm(P, dim=0)
        order = torch.argsort(S, descending=True, stable=True)
        S, V, P = S[order], V[:, order], P[:, order]
        U = torch.where(S > 0, P / torch.where(S > 0, S, 1.0), torch.zeros_like(P))
        return U, S, V.T
    _, U = torch.linalg.eigh(M @ M.T)  # (n, n)
    U = U.flip(-1)
    P = U.T @ M  # rows sigma_j v_j^T
    S = torch.linalg.vector_norm(P, dim=1)
    order = torch.argsort(S, descending=True, stable=True)
    S, U, P = S[order], U[:, order], P[order]
    Vh = torch.where(S[:, None] > 0, P / torch.where(S > 0, S, 1.0)[:, None], torch.zeros_like(P))
    return U, S, Vh


def factorize(E, s=None) -> ErrorSVD:
    """The float64 thin SVD of E diag(s) (s=None: of E), for error_spectrum and compensate."""
    E = _check_error(E)
    n, k = E.shape
    M = E.to(torch.float64)
    if s is not None:
        s = _check_scale(s, k, M.device)
        M = M * s[None, :]
    if min(n, k) == 0:
        z = M.new_zeros
        return ErrorSVD(z(n, 0), z(0), z(0, k), s, (n, k))
    try:
        U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    except torch.linalg.LinAlgError:
        U, S, Vh = _gram_svd(M)
    return ErrorSVD(U, S, Vh, s, (n, k))


def _as_svd(E, s) -> ErrorSVD:
    if isinstance(E, ErrorSVD):
        if s is not None:
            raise ValueError("pass s to factorize, not together with an ErrorSVD (it already holds its scale)")
        return E
    return factorize(E, s)


def error_spectrum(E, s=None) -> torch.Tensor:
    """Singular values (min(N, K),) float64, non-increasing, of E diag(s); E may be an ErrorSVD."""
    return _as_svd(E, s).S.clone()


def compensate(E, rank: int, s=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-`rank` factors A (N, r), B (r, K) float32 with E ~= A @ B: the truncated SVD of
    E diag(s), unscaled (A = U_r S_r, B = V_r^T diag(1/s)). E may be an ErrorSVD from factorize."""
    svd = _as_svd(E, s)
    m = svd.max_rank
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise ValueError(f"rank must be an int, got {rank!r}")
    rank = int(rank)
    if rank < 0 or rank > m:
        raise ValueError(f"rank must be in [0, min(N, K)] = [0, {m}] for E of shape {list(svd.shape)}, got {rank}")
    A = svd.U[:, :rank] * svd.S[:rank][None, :]
    B = svd.Vh[:rank]
    if svd.s is not None:
        B = B / svd.s[None, :]
    return A.to(torch.float32).contiguous(), B.to(torch.float32).contiguous()
