"""What MoEfication fits per layer: the neuron groups (the experts) and the router
(docs/methods.md, moe; crucible.moe.build.moefy puts them together into a Mixtral MoE).

    groups = balanced_groups(acts, n_groups=8, seed=0)       # acts [T, I]: silu(gate x) * up x
    mass = group_mass(acts, groups)                          # [T, E]
    weight = fit_router(hidden, mass, ridge=1e-3)            # hidden [T, H]: the FFN input
    router_quality(hidden, mass, weight, top_k=2)            # recall, mass covered, R^2, loads

Method
- Groups (`balanced_groups`): neurons that fire on the same tokens belong together, so that a token
  needs few experts. Each neuron's profile is its |a_j| over the calibration tokens, normalised to
  unit length; spherical k-means (sklearn.cluster.kmeans_plusplus seeding from `seed`; moefy passes
  derive_seed(seed, "moefy", i) for layer i) with a *balanced* assignment step, solved exactly as a
  linear assignment (each centroid offered I/E slots, scipy.optimize.linear_sum_assignment), so
  every group has exactly I/E neurons. Both steps never lower the summed cosine, so the iteration
  converges; it stops when the assignment repeats, the summed cosine gains less than `tol`
  (relative), or after `iters` rounds.
- Router (`fit_router`): per token the mass of group e is m_e = sum_{j in g_e} |a_j|; a ridge
  least-squares map from the FFN input (the post-attention-norm hidden state) to the shares
  m_e / sum m, centred per token (the softmax ignores a per-token shift), becomes `mlp.gate.weight`
  [E, H]. Predicted shares differ by tenths, so the router's softmax gives nearly equal weights to
  its top-k while ranking the groups by predicted mass. The router is fitted on the dense model's
  hidden states (not the MoE's own, which drift layer by layer), and has no bias, so a preference
  for one group is only expressible through the mean of the hidden state.

Contract
- balanced_groups(acts [T, I], n_groups, seed=0, iters=30, tol=1e-4) -> LongTensor [n_groups, I / n_groups]:
  a partition of range(I), each row ascending, rows ordered by their first neuron.
- shared_neurons(acts [T, I], n_shared, active) -> LongTensor [n_shared]: the neurons with the
  highest activation rate (firing = among a token's `active` largest |a_j|), ascending.
- group_mass(acts [T, I], groups [E, s]) -> [T, E] float64: the sum of |a_j| over each group.
- fit_router(hidden [T, H], mass [T, E], ridge=1e-3) -> weight [E, H] float32. ridge is relative to
  the mean diagonal of X^T X.
- router_quality(hidden, mass, weight, top_k) -> dict(recall, mass_covered, oracle_mass, r2, load).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

__all__ = ["shared_neurons", "balanced_groups", "group_mass", "fit_router", "router_quality"]

_TINY = 1e-12


def _int_param(value, name: str, low: int, high: int | None = None, where: str = "moefy") -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{where}: {name}={value!r} must be {bound}")
    return int(value)


def _balanced_assign(sim: np.ndarray, size: int) -> np.ndarray:
    """Labels [I] maximising the summed similarity with exactly `size` neurons per group."""
    rows, cols = linear_sum_assignment(-np.repeat(sim, size, axis=1))
    labels = np.empty(sim.shape[0], dtype=np.int64)
    labels[rows] = cols // size
    return labels


def balanced_groups(
    acts: torch.Tensor, n_groups: int, seed: int = 0, iters: int = 30, tol: float = 1e-4
) -> torch.Tensor:
    """Balanced spherical k-means of the neurons' normalised |activation| profiles (see the module
    docstring). acts [T, I] -> LongTensor [n_groups, I / n_groups]."""
    if acts.dim() != 2:
        raise ValueError(f"balanced_groups: acts shape={list(acts.shape)} must be [T, I]")
    n_neurons = acts.shape[1]
    n_groups = _int_param(n_groups, "n_groups", 1, where="balanced_groups")
    if n_neurons % n_groups:
        raise ValueError(f"balanced_groups: n_groups={n_groups} must divide the number of neurons {n_neurons}")
    size = n_neurons // n_groups
    f = acts.detach().abs().double().T.contiguous()  # [I, T]
    f = f / f.norm(dim=1, keepdim=True).clamp_min(_TINY)
    # k-means++ seeding on the unit profiles (squared Euclidean distance = 2 - 2 cosine)
    from sklearn.cluster import kmeans_plusplus

    seeds, _ = kmeans_plusplus(f.numpy(), n_groups, random_state=np.random.RandomState(int(seed)))
    centers = torch.from_numpy(seeds)
    labels, objective = None, -math.inf
    for _ in range(iters):
        sim = (f @ centers.T).numpy()
        new = _balanced_assign(sim, size)
        new_objective = float(sim[np.arange(n_neurons), new].sum())  # the summed cosine never drops
        if labels is not None and (
            np.array_equal(new, labels) or new_objective - objective <= tol * abs(new_objective)
        ):
            labels = new
            break
        labels, objective = new, new_objective
        lab = torch.from_numpy(labels)
        centers = torch.zeros_like(centers).index_add_(0, lab, f)
        centers = centers / centers.norm(dim=1, keepdim=True).clamp_min(_TINY)
    groups = [np.flatnonzero(labels == e) for e in range(n_groups)]
    groups.sort(key=lambda g: int(g[0]))
    return torch.from_numpy(np.stack(groups)).long()


def shared_neurons(acts: torch.Tensor, n_shared: int, active: int) -> torch.Tensor:
    """The `n_shared` neurons that fire on the most tokens (CMoE's activation rate): a neuron fires on
    a token when its |a_j| is among the token's `active` largest; ties by the mean |a_j|. acts [T, I]
    -> LongTensor [n_shared], ascending."""
    if acts.dim() != 2:
        raise ValueError(f"shared_neurons: acts shape={list(acts.shape)} must be [T, I]")
    n_neurons = acts.shape[1]
    n_shared = _int_param(n_shared, "n_shared", 0, n_neurons, where="shared_neurons")
    active = _int_param(active, "active", max(n_shared, 1), n_neurons, where="shared_neurons")
    if n_shared == 0:
        return torch.zeros(0, dtype=torch.long)
    a = acts.detach().abs().double()
    top = a.topk(active, dim=1).indices
    rate = torch.bincount(top.flatten(), minlength=n_neurons).double() / a.shape[0]
    mean = a.mean(0)
    # lexicographic: rate first, then the mean |a| (in [0, 1) after normalising) breaks ties
    key = rate + mean / (mean.max() + 1.0) / (a.shape[0] + 1.0)
    return key.topk(n_shared).indices.sort().values


def group_mass(acts: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[T, E] float64: per token, the sum of |a_j| over each group's neurons."""
    return acts.detach().abs().double()[:, groups].sum(-1)


def _centred_share(mass: torch.Tensor) -> torch.Tensor:
    """Each token's mass shares minus their mean 1/E: the softmax ignores a per-token shift."""
    m = mass.detach().double()
    share = m / m.sum(1, keepdim=True).clamp_min(_TINY)
    return share - share.mean(1, keepdim=True)


def fit_router(hidden: torch.Tensor, mass: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """Ridge least squares from the FFN input [T, H] to the groups' mass shares [T, E]; the router
    weight [E, H] float32 (Mixtral's router has no bias)."""
    if hidden.dim() != 2 or mass.dim() != 2 or hidden.shape[0] != mass.shape[0]:
        raise ValueError(
            f"fit_router: hidden shape={list(hidden.shape)} and mass shape={list(mass.shape)} must be [T, H] and [T, E]"
        )
    if not (math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"fit_router: ridge={ridge!r} must be finite and >= 0")
    x = hidden.detach().double()
    target = _centred_share(mass)
    gram = x.T @ x
    lam = ridge * float(gram.diagonal().mean()) if float(gram.diagonal().mean()) > 0 else ridge
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    weight = torch.linalg.lstsq(gram + (lam + _TINY) * eye, x.T @ target).solution  # [H, E]
    return weight.T.float().contiguous()


def router_quality(hidden: torch.Tensor, mass: torch.Tensor, weight: torch.Tensor, top_k: int) -> dict:
    """The router's recall of the oracle top-k groups, the mass its top-k covers, R^2, loads."""
    logits = hidden.detach().double() @ weight.detach().double().T
    m = mass.detach().double()
    total = m.sum(1).clamp_min(_TINY)
    chosen = logits.topk(top_k, dim=1).indices
    oracle = m.topk(top_k, dim=1).indices
    hits = (chosen.unsqueeze(2) == oracle.unsqueeze(1)).any(2).sum(1).double() / top_k
    share = _centred_share(m)
    ss_res = float(((logits - logits.mean(1, keepdim=True) - share) ** 2).sum())
    ss_tot = float(((share - share.mean(0)) ** 2).sum())
    load = torch.bincount(chosen.flatten(), minlength=m.shape[1]).double() / chosen.numel()
    return {
        "recall": float(hits.mean()),
        "mass_covered": float((m.gather(1, chosen).sum(1) / total).mean()),
        "oracle_mass": float((m.gather(1, oracle).sum(1) / total).mean()),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
        "load": [float(v) for v in load],
    }
