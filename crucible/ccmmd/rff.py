"""Random Fourier features for the CC-MMD kernel sums, O(n D d) (docs/methods.md, curate, "Kernel, bandwidths, sums").

Bochner: exp(-|x - y|^2 / (2 h^2)) = E[cos(omega.(x - y))] with omega ~ N(0, I / h^2), so with
phi(z) = sqrt(2 / D) cos(Omega z + beta), beta ~ U[0, 2 pi), k(x, y) ~= phi(x).phi(y), unbiased
pair by pair, error O(1 / sqrt(D)). A sum of bandwidths concatenates one block of D features per
bandwidth. Then K w ~= Phi_x (Phi_y^T w): O(n D d) instead of O(n^2 d).

The diagonal exclusion subtracts the features' own diagonal |phi(y_j)|^2 (not the exact k(y, y)),
which keeps every excluded sum an unbiased estimate of its exact value.

``rff_matvec`` mirrors ``kernels.kernel_matvec`` so the estimator can switch methods. Within a call
x and y share one feature map (same frequencies, same centring), so each returned sum is an unbiased
approximation of its exact value; a fixed seed makes the whole computation reproducible.
"""

from __future__ import annotations

import math

import torch

from crucible.seeding import torch_generator

from .kernels import _gammas, check_features

__all__ = ["rff_features", "rff_matvec"]


def rff_features(
    z: torch.Tensor, bandwidths, n_features: int, seed: int = 0, shift: torch.Tensor | None = None
) -> torch.Tensor:
    """Features (n, L * n_features), float64, with phi(x).phi(y) ~= sum_b k_b(x, y).

    z: (n, d). bandwidths: float or sequence of L floats. seed: frequencies come from a
    ``torch.Generator`` seeded here, so equal seeds give equal feature maps.
    Raises ValueError on non-finite features or n_features < 1.
    """
    z = check_features("z", z)
    if int(n_features) < 1:
        raise ValueError(f"n_features: {n_features}; valid values are integers >= 1")
    d = z.shape[1]
    g = torch_generator(int(seed))
    zz = z.detach().to(torch.float64)
    if shift is not None:
        zz = zz - shift.to(zz)
    feats = []
    for gamma in _gammas(bandwidths):
        scale = math.sqrt(2.0 * gamma)  # omega ~ N(0, 1/h^2), 1/h = sqrt(2 gamma)
        om = (torch.randn(d, n_features, generator=g, dtype=torch.float64) * scale).to(zz.device)
        beta = (torch.rand(n_features, generator=g, dtype=torch.float64) * 2 * math.pi).to(zz.device)
        feats.append(math.sqrt(2.0 / n_features) * torch.cos(zz @ om + beta))
    return torch.cat(feats, 1)


def rff_matvec(
    x: torch.Tensor,
    y: torch.Tensor | None,
    w: torch.Tensor,
    bandwidths,
    *,
    n_features: int = 2048,
    seed: int = 0,
    exclude_diagonal: bool = False,
    labels_x=None,
    labels_y=None,
    **_unused,
) -> torch.Tensor:
    """RFF approximation of ``kernels.kernel_matvec``: out[i, c] ~= sum_j k(x_i, y_j) w[j, c].

    Same shapes and arguments (block_size/backend are accepted and ignored); y = None means y = x.
    Returns float64 (n_x, k), or (n_x,) for 1-D w.
    """
    same = y is None
    y = x if same else y
    vec = w.dim() == 1
    w2 = (w[:, None] if vec else w).to(torch.float64)
    if w2.shape[0] != y.shape[0]:
        raise ValueError(f"w: expected {y.shape[0]} rows, got {w2.shape[0]}")
    if exclude_diagonal and x.shape[0] != y.shape[0]:
        raise ValueError(f"exclude_diagonal: needs as many x as y items, got {x.shape[0]} and {y.shape[0]}")
    # The frequencies are drawn in the centred frame of x; only differences matter, so any
    # common shift is exact, and centring keeps cos arguments small.
    shift = x.detach().to(torch.float64).mean(0)
    px = rff_features(x, bandwidths, n_features, seed, shift)
    py = px if same else rff_features(y, bandwidths, n_features, seed, shift)
    w2 = w2.to(px.device)
    if labels_x is None and labels_y is None:
        out = px @ (py.T @ w2)
    else:
        lx = torch.as_tensor(labels_x).to(px.device)
        ly = lx if (same and labels_y is None) else torch.as_tensor(labels_y).to(px.device)
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=px.device)
        for c in torch.unique(lx):
            ix, iy = lx == c, ly == c
            out[ix] = px[ix] @ (py[iy].T @ w2[iy])
    if exclude_diagonal:
        out = out - (px * py).sum(1, keepdim=True) * w2
    return out[:, 0] if vec else out
