"""OPCM: orthogonal projection-based continual merging (Tang et al., "Merging Models on the Fly
Without Retraining: A Sequential Approach to Scalable Continual Model Merging", 2025).

State: the merged task vector M_{t-1} (one model), the scale lambda_{t-1} and the running mean of
the task-vector norms. On arrival of tau_t, per matrix parameter:
  1. SVD of the merged task vector, M = U diag(s) V^T; k = energy_rank(s, alpha) (crucible.merge.
     base: smallest k holding `alpha` of sum s^2; the reference code thresholds the cumulative sum
     of s instead of s^2);
  2. project tau_t off the top-k singular subspace: remove every component u_i u_i^T tau v_j v_j^T
     with i, j < k, i.e. tau' = tau - P_U tau P_V with P_U = U_k U_k^T, P_V = V_k V_k^T; with
     `remove_diagonal` (default, as in the reference implementation) also remove the diagonal
     components u_i u_i^T tau v_i v_i^T for i >= k;
  3. S_t = lambda_{t-1} M_{t-1} + tau' (other parameters: tau unprojected, OPCM's own rule);
  4. rescale to the mean task-vector norm: lambda_t = ||S_t|| / mean_{s<=t} ||tau_s||,
     M_t = S_t / lambda_t (norms over the whole state dict).
The first task gives M_1 = tau_1, lambda_1 = 1.

All-or-nothing `add`: steps 1-3 for every matrix (the SVDs, the only computations that can fail)
run into new tensors S_t before the state is touched; the commit then swaps them in, updates the
other parameters in place (`mul_`, `add_`, `div_`: nothing allocated, nothing can fail) and sets
the scalars. Cost: one transient copy of the matrix parameters (the size of the incoming task
vector's matrices; each old M_{t-1} is freed as its S_t replaces it), the same as a snapshot of
them would cost, and less than a snapshot of the whole state (embeddings included).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from crucible.merge.base import (
    DEFAULT_EXCLUDE,
    ContinualMerger,
    StateDict,
    check_finite,
    energy_rank,
    global_norm,
    thin_svd,
)


def opcm_project(tau: Tensor, merged_tv: Tensor, alpha: float, remove_diagonal: bool = True) -> Tensor:
    """tau (m, n) with the components in merged_tv's top singular subspace removed (step 2 above).

    Raises ValueError on shape mismatch, non-2-D input, a NaN or inf in either, or alpha outside
    (0, 1].
    """
    if tau.ndim != 2 or tau.shape != merged_tv.shape:
        raise ValueError(
            f"opcm_project: need two matrices of one shape, got {tuple(tau.shape)} and {tuple(merged_tv.shape)}"
        )
    check_finite({"tau": tau, "merged_tv": merged_tv}, "opcm_project")
    work = torch.promote_types(tau.dtype, torch.float32)
    u, s, vh = thin_svd(merged_tv.to(work))
    k = energy_rank(s, alpha)
    v = vh.T
    coef = u.T @ tau.to(work) @ v  # (r, r) components u_i^T tau v_j
    mask = torch.zeros_like(coef)
    mask[:k, :k] = 1.0
    if remove_diagonal:
        mask.diagonal().fill_(1.0)
    return (tau.to(work) - u @ (coef * mask) @ v.T).to(tau.dtype)


class OPCM(ContinualMerger):
    """Continual OPCM; `alpha` the energy threshold of the merged task vector's kept subspace."""

    name = "opcm"

    def __init__(self, alpha: float = 0.5, remove_diagonal: bool = True, *, exclude: str | None = DEFAULT_EXCLUDE):
        super().__init__(exclude=exclude)
        energy_rank(torch.ones(1), alpha)  # validates alpha early
        self.alpha, self.remove_diagonal = float(alpha), bool(remove_diagonal)
        self.merged_tv: dict[str, Tensor] = {}
        self.lam = 1.0
        self.norm_sum = 0.0

    def _add(self, tv: StateDict) -> None:
        norm_sum = self.norm_sum + global_norm(tv.values())
        if not self.merged_tv:
            self.merged_tv = {k: v.clone() for k, v in tv.items()}
            self.lam, self.norm_sum = 1.0, norm_sum
            return
        staged: dict[str, Tensor] = {}  # S_t of each matrix; nothing of the state written yet
        sq = 0.0
        for k, tau in tv.items():
            held = self.merged_tv[k]
            if self.is_matrix(k):
                new = opcm_project(tau, held, self.alpha, self.remove_diagonal)
                staged[k] = new.add_(held * self.lam)
            else:  # the same two roundings as the in-place update in the commit below
                new = held * self.lam + tau
            sq += float(new.double().pow(2).sum())
            del new
        mean_norm = norm_sum / (self.num_tasks + 1)
        total = math.sqrt(sq)
        lam = total / mean_norm if mean_norm > 0 and total > 0 else 1.0
        for new in staged.values():
            new.div_(lam)
        # commit: swaps and in-place arithmetic on validated tensors, none of which can fail
        for k, tau in tv.items():
            if k in staged:
                self.merged_tv[k] = staged[k]
            else:
                self.merged_tv[k].mul_(self.lam).add_(tau).div_(lam)
        self.lam, self.norm_sum = lam, norm_sum

    def _delta(self, name: str) -> Tensor:
        return self.merged_tv[name].clone()

    def state_tensors(self) -> dict[str, Tensor]:
        return {f"merged/{k}": v for k, v in self.merged_tv.items()}
