"""Load-aware and uniform rank allocation under a total rank budget (docs/methods.md, quantize).

    ranks = allocate_ranks([sigma_1, ...], loads=[load_1, ...], budget=R)   # sigma_i: error_spectrum(...)
    ranks = uniform_ranks([len_1, ...], budget=R)
    weighted_error([sigma_1, ...], [load_1, ...], ranks)                     # what allocate_ranks minimises

Method
- Load-aware allocation ("Quantizing Mixture-of-Experts (MoE) models is difficult ...", the source
  abstract cited in docs/methods.md, References): under a total rank budget R over matrices (experts) with loads
  l_e (how often the router sends tokens to expert e; 1 for a dense layer), minimise the weighted
  error sum_e l_e * sum_{j > r_e} sigma_{e,j}^2 by giving rank units one at a time to the matrix
  with the largest marginal gain l_e * sigma_{e, r_e + 1}^2.

Why greedy is optimal (for non-increasing spectra). Write g_{e,j} = l_e sigma_{e,j}^2 (j = 1..m_e)
and G = sum of all g. The weighted error of ranks r is G - sum_e sum_{j <= r_e} g_{e,j}, so
minimising it means choosing, from each matrix, a *prefix* of its gains, R items in all, of the
largest total. Drop the prefix constraint: the best R items of any kind are the R largest gains.
Because g_{e,j} is non-increasing in j, some choice of the R largest gains is a union of prefixes
(if item j of matrix e is chosen and item j - 1 is not, swap them: g_{e,j-1} >= g_{e,j}, so the
total does not drop; repeat). So the relaxed optimum is attained by prefixes and is the optimum.
Greedy takes, at every step, the largest gain among the matrices' next items; since the next item
of a matrix is its largest remaining one, this is the largest remaining gain overall, so after R
steps greedy holds the R largest gains. Each unit lowers the error by exactly the gain it takes,
hence strictly while that gain is positive. The same argument shows the allocations are nested:
the ranks for budget R + 1 are those for R plus one unit.

Implementation: all gains are sorted at once by (-gain, matrix index, position), stable; the first
R items are exactly greedy's first R picks with ties broken toward the lowest matrix index (the
first item of this order among those left is always some matrix's next item, because its
predecessor in its matrix sorts before it). O(T log T) for T = sum of the spectra's lengths, no
Python loop over units or matrices. When R exceeds the number of positive gains, the remaining
units go to zero-gain items in the same order (lowest index first); they do not change the error.

Contract
- allocate_ranks(spectra, loads, budget) -> list[int]; uniform_ranks(lengths, budget) -> list[int];
  weighted_error(spectra, loads, ranks) -> float. spectra[i]: 1-D tensor, array or list, finite,
  >= 0, non-increasing; loads[i] finite and >= 0; budget an int in [0, sum of lengths]. Each
  violation raises ValueError naming the offending index and value.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np
import torch

__all__ = ["allocate_ranks", "uniform_ranks", "weighted_error"]


def _check_int(v, name: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if int(v) < lo:
        raise ValueError(f"{name} must be >= {lo}, got {int(v)}")
    return int(v)


def _check_spectra(spectra) -> list[np.ndarray]:
    out = []
    for i, sp in enumerate(spectra):
        if isinstance(sp, torch.Tensor):
            sp = sp.detach().cpu().to(torch.float64).numpy()
        a = np.asarray(sp, dtype=np.float64)
        if a.ndim != 1:
            raise ValueError(f"spectra[{i}] must be 1-D, got shape {list(a.shape)}")
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise ValueError(f"spectra[{i}] must be finite, got spectra[{i}][{bad[0]}] = {a[bad[0]]}")
        bad = np.flatnonzero(a < 0)
        if bad.size:
            raise ValueError(f"spectra[{i}] must be >= 0, got spectra[{i}][{bad[0]}] = {a[bad[0]]}")
        up = np.flatnonzero(np.diff(a) > 0)
        if up.size:
            j = int(up[0])
            raise ValueError(
                f"spectra[{i}] must be non-increasing, but spectra[{i}][{j}] = {a[j]} < "
                f"spectra[{i}][{j + 1}] = {a[j + 1]}"
            )
        out.append(a)
    return out


def _check_loads(loads, n: int) -> np.ndarray:
    if isinstance(loads, torch.Tensor):
        loads = loads.detach().cpu().to(torch.float64).numpy()
    w = np.asarray(loads, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"loads must be 1-D, got shape {list(w.shape)}")
    if w.shape[0] != n:
        raise ValueError(f"loads has {w.shape[0]} entries for {n} spectra")
    for i, v in enumerate(w):
        if not math.isfinite(v):
            raise ValueError(f"loads[{i}] must be finite, got {v}")
        if v < 0:
            raise ValueError(f"loads[{i}] must be >= 0, got {v}")
    return w


def _check_budget(budget, total: int) -> int:
    budget = _check_int(budget, "budget")
    if budget > total:
        raise ValueError(f"budget {budget} exceeds the total available rank {total} (the sum of the lengths)")
    return budget


def _gains(spectra: list[np.ndarray], loads: np.ndarray) -> list[np.ndarray]:
    gains = []
    for i, (a, w) in enumerate(zip(spectra, loads)):
        with np.errstate(over="ignore"):
            g = w * (a * a)
        if not np.all(np.isfinite(g)):
            raise ValueError(f"loads[{i}] * spectra[{i}]^2 overflows float64")
        gains.append(g)
    return gains


def allocate_ranks(spectra: Sequence, loads: Sequence, budget: int) -> list[int]:
    """Greedy load-aware ranks: the `budget` largest gains load_i * sigma_{i,j}^2 (optimal for
    non-increasing spectra; ties to the lowest matrix index). Sums to budget; ranks[i] <= len(spectra[i])."""
    spectra = _check_spectra(spectra)
    loads = _check_loads(loads, len(spectra))
    lengths = np.array([a.shape[0] for a in spectra], dtype=np.int64)
    budget = _check_budget(budget, int(lengths.sum()))
    n = len(spectra)
    if budget == 0 or n == 0:
        return [0] * n
    g = np.concatenate(_gains(spectra, loads))
    idx = np.repeat(np.arange(n, dtype=np.int64), lengths)
    pos = np.concatenate([np.arange(m, dtype=np.int64) for m in lengths])
    order = np.lexsort((pos, idx, -g))  # primary -gain, then matrix index, then position
    ranks = np.bincount(idx[order[:budget]], minlength=n)
    return [int(r) for r in ranks]


def uniform_ranks(lengths: Sequence[int], budget: int) -> list[int]:
    """The budget spread as evenly as possible: the largest level t with sum min(len_i, t) <= budget,
    then one more unit to each matrix longer than t, lowest index first, until the budget is spent."""
    lens = np.array([_check_int(m, f"lengths[{i}]") for i, m in enumerate(lengths)], dtype=np.int64)
    budget = _check_budget(budget, int(lens.sum()))
    if lens.size == 0:
        return []
    lo, hi = 0, int(lens.max())  # invariant: sum min(lens, lo) <= budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.minimum(lens, mid).sum()) <= budget:
            lo = mid
        else:
            hi = mid - 1
    ranks = np.minimum(lens, lo)
    left = budget - int(ranks.sum())
    if left:
        room = np.flatnonzero(lens > lo)[:left]  # left < len(room) by the choice of lo
        ranks[room] += 1
    return [int(r) for r in ranks]


def weighted_error(spectra: Sequence, loads: Sequence, ranks: Sequence[int]) -> float:
    """sum_i load_i * sum_{j > r_i} sigma_{i,j}^2 (j from 1), the load-weighted discarded energy."""
    spectra = _check_spectra(spectra)
    loads = _check_loads(loads, len(spectra))
    if len(ranks) != len(spectra):
        raise ValueError(f"ranks has {len(ranks)} entries for {len(spectra)} spectra")
    total = 0.0
    for i, (a, w, r) in enumerate(zip(spectra, loads, ranks)):
        r = _check_int(r, f"ranks[{i}]")
        if r > a.shape[0]:
            raise ValueError(f"ranks[{i}] = {r} exceeds len(spectra[{i}]) = {a.shape[0]}")
        total += float(w) * float(np.sum(a[r:] * a[r:]))
    return total
