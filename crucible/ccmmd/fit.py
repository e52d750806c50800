"""Minimum-CC-MMD estimation of a parametric model (docs/methods.md, curate, "Minimum-CC-MMD fitting").

A model draws samples z_hat = G_theta(noise) by reparameterisation. The CC-MMD^2 between the model
and the clean part of the pool, with model-side weights v and pool weights w (the corrected m_j),

    L(theta) = S_vv / D_v - 2 S_vw / D_vw + const,
    S_vv = sum_{i != i'} v_i v_i' k(z_hat_i, z_hat_i'),  S_vw = sum_{(i, j) allowed} v_i w_j k(z_hat_i, z_j),

depends on theta only through the model-side terms; the pool-pool term is a constant and is left
out. ``paired=True`` means z_hat_i is generated at pool item i (a conditional model at the pool's
x_i, carrying the same weight v = w): then the pairs i = j are excluded and D_vw = N^2 - sum w^2, so
every product of weights has j != l and stays design-unbiased (E[m_j m_l] = M_j M_l).

The gradient w.r.t. z_hat is closed-form and computed blockwise by ``kernel_matvec`` (for a
Gaussian k_b, grad_a k_b(a, b) = -2 gamma_b k_b (a - b)), then backpropagated into theta through
G_theta by autograd; no n x n matrix and no autograd graph through the kernel.

Demonstration (``benchmarks/ccmmd_regression.py``): contaminated linear regression, kernel on (x, y)
jointly, comparing least squares, naive min-MMD (w = 1), trusted-only (w = I M / pi) and
min-CC-MMD (w = m).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from crucible.seeding import numpy_rng, torch_generator

from .kernels import _gammas, check_features, kernel_matvec

__all__ = ["FitResult", "fit_min_ccmmd", "linear_gaussian_sampler", "contaminated_regression", "weighted_mmd_loss"]


def _loss_and_grad(zh, z, v, w, gammas, paired, block):
    n_v, n_w = float(v.sum()), float(w.sum())
    d_v = n_v**2 - float((v * v).sum())
    d_vw = n_v * n_w - (float((v * w).sum()) if paired else 0.0)
    if not (d_v > 0 and d_vw > 0):
        raise ValueError(
            f"weights: normalisers D_v = {d_v:.4g}, D_vw = {d_vw:.4g} must be > 0 (fewer than two effective items)"
        )
    loss = 0.0
    grad = torch.zeros_like(zh, dtype=torch.float64)
    zh64, z64 = zh.to(torch.float64), z.to(torch.float64)
    for gm in gammas:
        h = (0.5 / gm) ** 0.5
        kv = kernel_matvec(
            zh, None, torch.cat([v[:, None], v[:, None] * zh64], 1), h, exclude_diagonal=True, block_size=block
        )
        kw = kernel_matvec(
            zh, z, torch.cat([w[:, None], w[:, None] * z64], 1), h, exclude_diagonal=paired, block_size=block
        )
        loss += float((v * kv[:, 0]).sum()) / d_v - 2.0 * float((v * kw[:, 0]).sum()) / d_vw
        g_vv = 2.0 * v[:, None] * (zh64 * kv[:, :1] - kv[:, 1:])
        g_vw = v[:, None] * (zh64 * kw[:, :1] - kw[:, 1:])
        grad += -2.0 * gm * (g_vv / d_v - 2.0 * g_vw / d_vw)
    return loss, grad


class _MMDModelTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, zh, z, v, w, gammas, paired, block):
        loss, grad = _loss_and_grad(zh.detach(), z, v, w, gammas, paired, block)
        ctx.save_for_backward(grad.to(zh.dtype))
        return zh.new_tensor(loss)

    @staticmethod
    def backward(ctx, g_out):
        (grad,) = ctx.saved_tensors
        return g_out * grad, None, None, None, None, None, None


def weighted_mmd_loss(
    z_hat: torch.Tensor,
    z: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    bandwidths,
    *,
    paired: bool,
    block_size: int | None = None,
) -> torch.Tensor:
    """The theta-dependent part of the weighted MMD^2, differentiable in z_hat (n_hat, d).

    z: (n, d) pool; v: (n_hat,) model weights; w: (n,) pool weights (float64). Returns a scalar.
    """
    return _MMDModelTerms.apply(
        z_hat, z, v.to(torch.float64), w.to(torch.float64), _gammas(bandwidths), paired, block_size
    )


@dataclass(frozen=True)
class FitResult:
    """Fitted parameters (detached), the loss trace (model-side CC-MMD^2 terms) and settings."""

    params: dict
    losses: list
    bandwidths: tuple


def fit_min_ccmmd(
    sampler: Callable[[dict, torch.Tensor], torch.Tensor],
    params: dict,
    pool: torch.Tensor,
    weights: torch.Tensor,
    bandwidths,
    *,
    noise_shape,
    model_weights: torch.Tensor | None = None,
    paired: bool = True,
    steps: int = 300,
    lr: float = 0.05,
    seed: int = 0,
    resample: bool = False,
    block_size: int | None = None,
) -> FitResult:
    """Minimum-CC-MMD: Adam on ``params`` to minimise the CC-MMD^2 between model and clean pool.

    sampler(params, noise) -> (n_hat, d) model samples, differentiable in params. params: dict of
    leaf tensors (optimised in place; copies are returned). pool: (n, d). weights: (n,) pool
    weights (corrected m_j for CC-MMD, ones for naive, I M / pi for trusted-only). model_weights:
    (n_hat,), default ``weights`` when paired else ones. noise_shape: shape of the standard normal
    noise; fixed across steps (common random numbers) unless ``resample``. Raises ValueError on
    non-finite pool features or normalisers <= 0.
    """
    z = check_features("pool", pool)
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (z.shape[0],):
        raise ValueError(f"weights: expected shape ({z.shape[0]},), got {tuple(w.shape)}")
    g = torch_generator(seed)
    noise = torch.randn(noise_shape, generator=g, dtype=torch.float64)
    v = (
        w
        if (model_weights is None and paired)
        else (
            torch.ones(noise_shape[0], dtype=torch.float64)
            if model_weights is None
            else torch.as_tensor(model_weights, dtype=torch.float64)
        )
    )
    leaves = [p.requires_grad_(True) for p in params.values()]
    opt = torch.optim.Adam(leaves, lr=lr)
    losses = []
    for _ in range(steps):
        if resample:
            noise = torch.randn(noise_shape, generator=g, dtype=torch.float64)
        opt.zero_grad()
        loss = weighted_mmd_loss(sampler(params, noise), z, v, w, bandwidths, paired=paired, block_size=block_size)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    out = {k: p.detach().clone() for k, p in params.items()}
    hs = (bandwidths,) if isinstance(bandwidths, (int, float)) else tuple(bandwidths)
    return FitResult(params=out, losses=losses, bandwidths=hs)


def linear_gaussian_sampler(x: torch.Tensor) -> Callable[[dict, torch.Tensor], torch.Tensor]:
    """Sampler of the model y = x beta + b0 + exp(log_sigma) e at the given x, as joint (x, y).

    x: (n, p). params: {"beta": (p,), "intercept": (), "log_sigma": ()}; noise: (n,).
    """
    x64 = torch.as_tensor(x, dtype=torch.float64)

    def sample(params: dict, noise: torch.Tensor) -> torch.Tensor:
        y = x64 @ params["beta"] + params["intercept"] + params["log_sigma"].exp() * noise
        return torch.cat([x64, y[:, None]], 1)

    return sample


def contaminated_regression(
    n: int,
    eps: float,
    *,
    p: int = 3,
    sigma: float = 0.5,
    seed: int = 0,
    beta=None,
    contaminant_beta=None,
    contaminant_shift: float = 2.0,
) -> dict:
    """Synthetic pool for the demo: clean y = x beta + sigma e, contaminants y = x beta_c + shift + e.

    Membership M_j ~ Bernoulli(1 - eps); x ~ N(0, I_p) for both. Returns numpy arrays x (n, p),
    y (n,), member (n,), and beta (p,).
    """
    rng = numpy_rng(seed)
    beta = np.linspace(1.0, -1.0, p) if beta is None else np.asarray(beta, float)
    beta_c = -beta if contaminant_beta is None else np.asarray(contaminant_beta, float)
    x = rng.standard_normal((n, p))
    member = (rng.random(n) >= eps).astype(float)
    clean = x @ beta + sigma * rng.standard_normal(n)
    dirty = x @ beta_c + contaminant_shift + sigma * rng.standard_normal(n)
    y = np.where(member == 1, clean, dirty)
    return {"x": x, "y": y, "member": member, "beta": beta}
