"""GS3R: Global Singular Subspace Separation and Restoration, with Pre-merge Restoration and
Flushing (PRF), for continual model merging (docs/methods.md, merge; our reading of the abstract).

Per matrix parameter (m, n) the state is a low-rank factorisation of the merged update,

    Delta = U diag(w) V^T,   w_i = scale * b_{owner(i)} * sigma_i,

with U (m, r) and V (n, r) orthonormal *global bases* shared by all tasks so far, sigma (r,) and
owner (r,) the task each component belongs to, r <= the rank budget K. On arrival of tau_t:

1. separation (`separate`): truncated SVD tau_t ~ P_k S_k Q_k^T with k = energy_rank(S, energy)
   (crucible.merge.base); project P_k off U and Q_k off V (twice, for numerical orthogonality) and
   orthonormalise, dropping directions whose residual singular value is below `sep_tol` (already
   inside the held bases) -> U_t' (m, k_u), V_t' (n, k_v). New components never overwrite the
   directions of an earlier task, so there is no collapse toward the latest task and no 1/t
   shrinkage of early ones.
2. restoration (`restoration`): R_t = U_t'^T tau_t V_t' (k_u, k_v), the closed-form least-squares
   solution of min_R ||tau_t - U_t' R V_t'^T||_F. Since U_t' is orthogonal to U and V_t' to V,
   U_t'^T Delta V_t' = R_t after the merge: task t is reproduced exactly on its own subspace
   (up to balance), and exactly overall when its singular subspaces are disjoint from the
   earlier tasks' and energy = 1. R_t is stored diagonalised: with R_t = A diag(sigma) B^T,
   U_t' A and V_t' B join the bases (same spans, same product).
3. balance (`balance_factors`): at merge time each task's contribution is scaled by
   b_s = (mean_s' n_s' / n_s) ** balance, n_s the norm of task s's held components (over the
   whole model with balance_scope="model", or per parameter with "layer"): balance = 1 gives every
   task the same norm, 0 turns balancing off; one task, or tasks of equal norm, give b = 1.
4. global re-truncation (`retruncate`): when r exceeds the budget K, keep the K components of
   largest task-balanced singular value sigma_i / n_{owner(i)} (n per parameter), every task
   keeping at least its leading component while K >= the number of tasks present.
5. PRF: steps 1-2 read tau_t before anything of it enters the state; afterwards the merger holds
   no reference to it, so the caller flushes the incoming model and task vector right after
   `add`. Peak memory: theta_0 + one incoming model (+ its task vector, + one SVD workspace per
   parameter) + the low-rank state, whose size (m + n + 2) K per parameter does not depend on the
   number of tasks once the budget is full.

All-or-nothing `add`, without doubling the state: each matrix is updated in turn, and its undo
record keeps only what the update threw away, the components re-truncation dropped (at most as
many as the new task brought in; the kept old ones are still in the new factors, first, in their
order). If anything raises (an SVD, a check, memory), the matrices already updated are rebuilt
exactly from their new factors and those records, in reverse order. The other parameters are
added last, in place (nothing allocated, nothing can fail). A snapshot, or staging every matrix's
new factors before committing, would instead hold the low-rank state twice, up to (m + n) K per
matrix; the records hold at most the incoming task's share of it.

Other parameters (not 2-D, or matching `exclude`: biases, norms, embeddings): task arithmetic,
theta_0 + lam * sum tau with lam = `other_lambda`, or 1/t (the mean) when None, so the merge of one
task is that task.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from crucible.merge.base import DEFAULT_EXCLUDE, ContinualMerger, StateDict, energy_rank, nonfinite_report, thin_svd


def _orthonormal_residual(basis: Tensor, held: Tensor, tol: float) -> Tensor:
    """Orthonormal basis of span(basis) minus its part in span(held) (held orthonormal).

    Directions whose residual singular value is <= tol are dropped (already held). Computed in
    float64 from the eigendecomposition of the small Gram matrix x^T x (k x k): the residual x is
    nearly rank-deficient by construction, and eigh of x^T x gives its singular values squared and
    right singular vectors, so q = x W diag(lambda)^(-1/2) spans the same space as the left
    singular vectors an SVD of the tall x would give, at a fraction of the cost (a thin SVD of a
    (1536, 250) float64 matrix took 20x the eigh on 1 CPU thread). In float64, lambda down to
    tol^2 = 1e-8 keeps q orthonormal to ~eps * lambda_max / tol^2 (~1e-8 for a unit-norm basis),
    below the float32 the state is held in.
    """
    x = basis.double()
    if held.shape[1]:
        h = held.double()
        for _ in range(2):  # re-orthogonalisation: one Gram-Schmidt pass loses orthogonality
            x = x - h @ (h.T @ x)
    if x.shape[1] == 0:
        return x.to(basis.dtype)
    lam, w = torch.linalg.eigh(x.T @ x)
    keep = lam > tol * tol
    return (x @ (w[:, keep] / lam[keep].sqrt())).to(basis.dtype)


def top_singular(tau: Tensor, energy: float) -> tuple[Tensor, Tensor, Tensor]:
    """tau's leading singular triplets, as many as hold `energy` of its squared singular values
    (k = energy_rank): (P_k (m, k), s_k (k,), Q_k (n, k)), in tau's dtype.

    From the eigendecomposition of the smaller Gram matrix (tau^T tau or tau tau^T) in float64,
    not a full SVD: GS3R keeps only the top-energy subspace, and eigh of the (n, n) Gram matrix
    cost 0.5-0.7x a float32 SVD of a (1536, 384) or (384, 1536) matrix on 1 CPU thread. The Gram
    matrix squares the spectrum, so a singular value is resolved down to ~1e-8 of the largest:
    components below `1e-5 * s_max` are not taken (noise to the float32 state), and the kept ones'
    vectors P_k = tau Q_k / s_k are orthonormal to ~1e-6 or better. Raises ValueError on NaN / inf.
    """
    report = nonfinite_report(tau)
    if report is not None:
        raise ValueError(f"top_singular: the {tuple(tau.shape)} matrix has {report}")
    x = tau.double()
    tall = x.shape[0] >= x.shape[1]
    lam, w = torch.linalg.eigh(x.T @ x if tall else x @ x.T)  # ascending
    s, w = lam.flip(0).clamp_min(0).sqrt(), w.flip(1)
    k = energy_rank(s, energy)
    if k:
        k = min(k, int((s > 1e-5 * s[0]).sum()))
    s, w = s[:k], w[:, :k]
    other = ((x @ w) if tall else (x.T @ w)) / s
    p, q = (other, w) if tall else (w, other)
    return p.to(tau.dtype), s.to(tau.dtype), q.to(tau.dtype)


def separate(tau: Tensor, U: Tensor, V: Tensor, energy: float, sep_tol: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Step 1: the new task's singular bases, truncated by energy and separated from U, V.

    tau (m, n); U (m, r), V (n, r) orthonormal (r may be 0). Returns U_t' (m, k_u), V_t' (n, k_v)
    orthonormal with U^T U_t' = 0 and V^T V_t' = 0 (to working precision).
    """
    p, _, q = top_singular(tau, energy)
    return _orthonormal_residual(p, U, sep_tol), _orthonormal_residual(q, V, sep_tol)


def restoration(tau: Tensor, U_t: Tensor, V_t: Tensor) -> Tensor:
    """Step 2: R_t = U_t^T tau V_t, argmin_R ||tau - U_t R V_t^T||_F for orthonormal U_t, V_t."""
    return U_t.T @ tau @ V_t


def balance_factors(norms: dict[int, float], balance: float) -> dict[int, float]:
    """Step 3: b_s = (mean of the non-zero norms / n_s) ** balance; 1.0 for zero-norm tasks."""
    live = [n for n in norms.values() if n > 0]
    if not live or balance == 0:
        return {s: 1.0 for s in norms}
    mean = sum(live) / len(live)
    return {s: (mean / n) ** balance if n > 0 else 1.0 for s, n in norms.items()}


def retruncate(sigma: Tensor, owner: Tensor, budget: int) -> Tensor:
    """Step 4: indices (ascending) of the `budget` components to keep.

    Ranked by sigma_i / ||sigma of owner(i)||; while budget >= the number of owners each owner
    keeps its leading component first.
    """
    if sigma.numel() <= budget:
        return torch.arange(sigma.numel())
    norms = torch.zeros(int(owner.max()) + 1, dtype=torch.float64)
    norms.index_add_(0, owner.long(), sigma.double().pow(2))
    score = sigma.double() / norms.sqrt().clamp(min=1e-300)[owner.long()]
    order = torch.argsort(score, descending=True, stable=True).tolist()
    owners = owner.unique().tolist()
    chosen: list[int] = []
    if budget >= len(owners):
        seen: set[int] = set()
        for i in order:
            o = int(owner[i])
            if o not in seen:
                seen.add(o)
                chosen.append(i)
    taken = set(chosen)
    for i in order:
        if len(chosen) >= budget:
            break
        if i not in taken:
            chosen.append(i)
            taken.add(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)


class GS3R(ContinualMerger):
    """Continual GS3R merger; see the module docstring for the algorithm and the memory contract.

    energy: share of tau_t's squared singular values kept at separation, in (0, 1].
    rank_budget: K per matrix, an int, or a float in (0, 1] read as a share of min(m, n).
    balance: exponent of the per-task balance (0 off, 1 equal norms); balance_scope "model"/"layer".
    scale: global factor on the matrix updates. other_lambda: task-arithmetic factor of the other
    parameters (None: 1/t). sep_tol: residual singular value below which a new direction counts as
    already held. dtype: working and state precision of the matrix factors.
    """

    name = "gs3r"

    def __init__(
        self,
        energy: float = 0.9,
        rank_budget: float | int = 0.5,
        balance: float = 1.0,
        balance_scope: str = "model",
        scale: float = 1.0,
        other_lambda: float | None = None,
        sep_tol: float = 1e-4,
        dtype: torch.dtype = torch.float32,
        *,
        exclude: str | None = DEFAULT_EXCLUDE,
    ):
        super().__init__(exclude=exclude)
        energy_rank(torch.ones(1), energy)  # validates energy early
        if isinstance(rank_budget, bool) or not (
            (isinstance(rank_budget, int) and rank_budget >= 1)
            or (isinstance(rank_budget, float) and 0.0 < rank_budget <= 1.0)
        ):
            raise ValueError(f"gs3r: rank_budget must be an int >= 1 or a float in (0, 1], got {rank_budget!r}")
        if balance < 0:
            raise ValueError(f"gs3r: balance must be >= 0, got {balance}")
        if balance_scope not in ("model", "layer"):
            raise ValueError(f"gs3r: balance_scope must be 'model' or 'layer', got {balance_scope!r}")
        self.energy, self.rank_budget, self.balance = float(energy), rank_budget, float(balance)
        self.balance_scope, self.scale, self.other_lambda = balance_scope, float(scale), other_lambda
        self.sep_tol, self.dtype = float(sep_tol), dtype
        self.U: dict[str, Tensor] = {}
        self.V: dict[str, Tensor] = {}
        self.sigma: dict[str, Tensor] = {}
        self.owner: dict[str, Tensor] = {}
        self.other_sum: dict[str, Tensor] = {}
        self._model_balance: dict[int, float] | None = None

    def budget(self, name: str) -> int:
        m, n = self._spec[name][0]
        if isinstance(self.rank_budget, int):
            return min(self.rank_budget, m, n)
        return max(1, math.floor(self.rank_budget * min(m, n)))

    # -- continual update ---------------------------------------------------------------------

    def _add(self, tv: StateDict) -> None:
        t = self.num_tasks
        first_other = {k: tau.clone() for k, tau in tv.items() if not self.is_matrix(k) and k not in self.other_sum}
        undo: list[tuple] = []
        try:
            for name, tau in tv.items():
                if self.is_matrix(name):
                    record = self._add_matrix(name, tau.to(self.dtype), t)
                    if record is not None:
                        undo.append(record)
        except BaseException:
            for record in reversed(undo):
                self._undo_matrix(*record)
            raise
        # commit of the other parameters: in-place sums on validated tensors cannot fail
        for name, tau in tv.items():
            if name in first_other:
                self.other_sum[name] = first_other[name]
            elif not self.is_matrix(name):
                self.other_sum[name].add_(tau)
        self._model_balance = None

    def _add_matrix(self, name: str, tau: Tensor, t: int) -> tuple | None:
        """Merge task t's components of one matrix into the state; return the undo record for
        `_undo_matrix` (None when the state was left as it was)."""
        existed = name in self.U
        if existed:
            U, V, sigma, owner = self.U[name], self.V[name], self.sigma[name], self.owner[name]
        else:
            m, n = tau.shape
            U = torch.zeros(m, 0, dtype=self.dtype, device=tau.device)
            V = torch.zeros(n, 0, dtype=self.dtype, device=tau.device)
            sigma = torch.zeros(0, dtype=self.dtype, device=tau.device)
            owner = torch.zeros(0, dtype=torch.int32, device=tau.device)
        held, r = (U, V, sigma, owner), sigma.numel()
        dropped = torch.zeros(0, dtype=torch.long, device=sigma.device)
        if r == 0:  # nothing held: tau's own top-k singular triplets are steps 1-2's result
            U_t, s, V_t = top_singular(tau, self.energy)
        else:
            U_t, V_t = separate(tau, U, V, self.energy, self.sep_tol)
        if r and U_t.shape[1] and V_t.shape[1]:
            R = restoration(tau, U_t, V_t)  # pre-merge restoration: from tau_t, before merging
            a, s, bh = thin_svd(R)
            U_t, V_t, s = U_t @ a, V_t @ bh.T, s
        if U_t.shape[1] and V_t.shape[1]:  # else nothing of it is outside the held bases
            tol = float(s[0]) * max(U_t.shape[1], V_t.shape[1]) * torch.finfo(s.dtype).eps if s.numel() else 0.0
            keep = s > tol
            U_t, V_t, s = U_t[:, keep], V_t[:, keep], s[keep]
            cand_sigma = torch.cat([sigma, s])
            cand_owner = torch.cat([owner, torch.full((s.numel(),), t, dtype=torch.int32, device=s.device)])
            idx = torch.arange(cand_sigma.numel(), device=sigma.device)
            if cand_sigma.numel() > self.budget(name):
                idx = retruncate(cand_sigma.cpu(), cand_owner.cpu(), self.budget(name)).to(sigma.device)
            old_kept, new_kept = idx[idx < r], idx[idx >= r] - r
            dropped = torch.ones(r, dtype=torch.bool, device=sigma.device)
            dropped[old_kept] = False
            dropped = dropped.nonzero().squeeze(1)
            # the kept old components first, in their order: what _undo_matrix relies on
            U = torch.cat([U[:, old_kept], U_t[:, new_kept]], 1).contiguous()
            V = torch.cat([V[:, old_kept], V_t[:, new_kept]], 1).contiguous()
            sigma, owner = cand_sigma[idx], cand_owner[idx]
        elif existed:
            return None
        record = (name, existed, r, dropped, *(x[..., dropped] for x in held))  # copies
        self.U[name], self.V[name], self.sigma[name], self.owner[name] = U, V, sigma, owner
        return record

    def _undo_matrix(self, name: str, existed: bool, r: int, dropped: Tensor, *dropped_parts: Tensor) -> None:
        """Restore one matrix's factors as they were before `_add_matrix` (exact copies)."""
        if not existed:
            for part in (self.U, self.V, self.sigma, self.owner):
                del part[name]
            return
        kept = torch.ones(r, dtype=torch.bool, device=dropped.device)
        kept[dropped] = False
        kept = kept.nonzero().squeeze(1)
        for part, gone in zip((self.U, self.V, self.sigma, self.owner), dropped_parts):
            new = part[name]
            old = new.new_empty(*new.shape[:-1], r)
            old[..., kept] = new[..., : kept.numel()]
            old[..., dropped] = gone
            part[name] = old

    # -- merge ----------------------------------------------------------------------------------

    def task_norms(self, name: str | None = None) -> dict[int, float]:
        """Norm of each task's held components, in one matrix parameter or (None) all of them."""
        sq: dict[int, float] = defaultdict(float)
        for k in [name] if name is not None else self.sigma:
            for o, s in zip(self.owner[k].tolist(), self.sigma[k].double().pow(2).tolist()):
                sq[o] += s
        return {o: math.sqrt(v) for o, v in sorted(sq.items())}

    def _balance(self, name: str) -> dict[int, float]:
        if self.balance_scope == "layer":
            return balance_factors(self.task_norms(name), self.balance)
        if self._model_balance is None:
            self._model_balance = balance_factors(self.task_norms(), self.balance)
        return self._model_balance

    def _delta(self, name: str) -> Tensor:
        dtype = self._spec[name][1]
        if not self.is_matrix(name):
            lam = self.other_lambda if self.other_lambda is not None else 1.0 / self.num_tasks
            return (self.other_sum[name] * lam).to(dtype)
        U, V, sigma, owner = self.U[name], self.V[name], self.sigma[name], self.owner[name]
        b = self._balance(name)
        factor = torch.tensor([b.get(o, 1.0) for o in owner.tolist()], dtype=sigma.dtype, device=sigma.device)
        return ((U * (sigma * factor * self.scale)) @ V.T).to(dtype)

    # -- introspection --------------------------------------------------------------------------

    def ranks_used(self) -> dict[str, int]:
        """Components held per matrix parameter (<= its budget)."""
        return {k: int(v.numel()) for k, v in self.sigma.items()}

    def ranks_by_task(self) -> dict[str, dict[int, int]]:
        """Per matrix parameter, how many components each task holds."""
        out = {}
        for k, o in self.owner.items():
            counts = torch.bincount(o.long().cpu()).tolist() if o.numel() else []
            out[k] = {task: c for task, c in enumerate(counts) if c > 0}
        return out

    def state_tensors(self) -> dict[str, Tensor]:
        out = {}
        for part in ("U", "V", "sigma", "owner", "other_sum"):
            out.update({f"{part}/{k}": v for k, v in getattr(self, part).items()})
        return out
