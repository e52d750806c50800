"""TIES-Merging in continual form (Yadav et al., "TIES-Merging: Resolving Interference When
Merging Models", NeurIPS 2023).

Batch TIES over task vectors tau_1..tau_T, per element:
  1. trim:  keep the top `density` share of each task vector's entries by magnitude (over the
            whole task vector by default, as in the paper; per tensor with scope="tensor"),
            zero the rest  -> tau_s^;
  2. elect: gamma = sign(sum_s tau_s^);
  3. disjoint mean: mean of the tau_s^ whose sign equals gamma (zeros excluded);
  theta = theta_0 + lam * disjoint mean.

Continual form (exact, not an approximation): steps 2 and 3 only need, per element, the sum and
the count of the positive trimmed entries and of the negative ones:
    gamma = sign(P + N),  mean = P / n_plus if gamma >= 0 else N / n_minus.
So the state is P, N (float) and n_plus, n_minus (int16) per element: 12 bytes per weight,
whatever the number of tasks, and after T arrivals the merge equals batch TIES on all T tasks.
An exact tie P + N = 0 with non-zero entries elects +. Trimming keeps |x| >= the k-th largest
magnitude, so ties at the threshold may keep slightly more than the share.

All-or-nothing `add`: the trim (the only data-dependent step, and the largest allocation) runs
before the state is touched; the accumulation then writes through `out=` into two scratch
buffers the size of the largest parameter (6 bytes per element of it) and in-place `add_`, so it
allocates nothing and cannot fail part way. Snapshotting the state instead would cost 12 bytes
per weight of the whole model.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from crucible.merge.base import DEFAULT_EXCLUDE, ContinualMerger, StateDict, check_finite

_MAX_COUNT = torch.iinfo(torch.int16).max


def ties_trim(tv: StateDict, density: float, scope: str = "global") -> dict[str, Tensor]:
    """Step 1: keep the entries with the top `density` share of magnitudes, zero the rest.

    scope="global": one threshold over all entries of the task vector; "tensor": one per tensor.
    Raises ValueError unless 0 < density <= 1 and scope is one of the two, and when a tensor holds
    a NaN or inf (a NaN magnitude would be silently trimmed away, an inf kept forever).
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"TIES density must be in (0, 1], got {density}")
    if scope not in ("global", "tensor"):
        raise ValueError(f"TIES trim scope must be 'global' or 'tensor', got {scope!r}")
    check_finite(tv, "ties_trim")

    def threshold(mags: Tensor) -> Tensor:
        k = max(1, math.ceil(density * mags.numel()))
        return torch.kthvalue(mags.float(), mags.numel() - k + 1).values

    if density == 1.0:
        return {k: v.clone() for k, v in tv.items()}
    if scope == "global":
        thr = threshold(torch.cat([v.detach().abs().flatten() for v in tv.values()]))
        return {k: torch.where(v.abs() >= thr, v, torch.zeros_like(v)) for k, v in tv.items()}
    return {k: torch.where(v.abs() >= threshold(v.abs().flatten()), v, torch.zeros_like(v)) for k, v in tv.items()}


def ties_elect(pos_sum: Tensor, neg_sum: Tensor) -> Tensor:
    """Step 2: the elected sign, +1 or -1 per element (sign of the sum of trimmed entries; 0 -> +1)."""
    return torch.where(pos_sum + neg_sum >= 0, 1.0, -1.0).to(pos_sum.dtype)


def ties_disjoint_mean(pos_sum: Tensor, neg_sum: Tensor, n_pos: Tensor, n_neg: Tensor, sign: Tensor) -> Tensor:
    """Step 3: mean of the entries agreeing with the elected sign (0 where none does)."""
    pos = pos_sum / n_pos.clamp(min=1).to(pos_sum.dtype)
    neg = neg_sum / n_neg.clamp(min=1).to(neg_sum.dtype)
    return torch.where(sign > 0, pos, neg)


class TIES(ContinualMerger):
    """Continual TIES: trim each arrival, accumulate signed sums and counts; elect and average
    at `merged()` time. See the module docstring for the exactness argument."""

    name = "ties"

    def __init__(
        self, density: float = 0.2, lam: float = 1.0, scope: str = "global", *, exclude: str | None = DEFAULT_EXCLUDE
    ):
        super().__init__(exclude=exclude)
        ties_trim({"x": torch.ones(1)}, density, scope)  # validates the arguments early
        self.density, self.lam, self.scope = float(density), float(lam), scope
        self.pos_sum: dict[str, Tensor] = {}
        self.neg_sum: dict[str, Tensor] = {}
        self.n_pos: dict[str, Tensor] = {}
        self.n_neg: dict[str, Tensor] = {}

    def _add(self, tv: StateDict) -> None:
        if self.num_tasks >= _MAX_COUNT:
            raise ValueError(f"ties: at most {_MAX_COUNT} tasks (int16 counts)")
        trimmed = ties_trim(tv, self.density, self.scope)  # ours: consumed in place below
        if self.pos_sum:
            parts = (self.pos_sum, self.neg_sum, self.n_pos, self.n_neg)
        else:  # first arrival: a fresh state, assigned only once it is complete
            parts = tuple(
                {
                    k: torch.zeros(x.shape, dtype=x.dtype if dt is None else dt, device=x.device)
                    for k, x in trimmed.items()
                }
                for dt in (None, None, torch.int16, torch.int16)
            )
        pos_sum, neg_sum, n_pos, n_neg = parts
        size: dict[tuple, int] = {}
        for x in trimmed.values():
            for key in ((x.dtype, x.device), (torch.int16, x.device)):
                size[key] = max(size.get(key, 0), x.numel())
        scratch = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in size.items()}
        # from here on nothing allocates: in-place arithmetic on validated tensors cannot fail
        for k, x in trimmed.items():
            f = scratch[(x.dtype, x.device)][: x.numel()].view(x.shape)
            c = scratch[(torch.int16, x.device)][: x.numel()].view(x.shape)
            n_pos[k].add_(torch.gt(x, 0, out=c))
            n_neg[k].add_(torch.lt(x, 0, out=c))
            neg_sum[k].add_(torch.clamp(x, max=0, out=f))
            pos_sum[k].add_(x.clamp_(min=0))
        self.pos_sum, self.neg_sum, self.n_pos, self.n_neg = parts

    def _delta(self, name: str) -> Tensor:
        p, n = self.pos_sum[name], self.neg_sum[name]
        sign = ties_elect(p, n)
        return ties_disjoint_mean(p, n, self.n_pos[name], self.n_neg[name], sign) * self.lam

    def state_tensors(self) -> dict[str, Tensor]:
        out = {}
        for part in ("pos_sum", "neg_sum", "n_pos", "n_neg"):
            out.update({f"{part}/{k}": v for k, v in getattr(self, part).items()})
        return out
