"""MagMax (Marczak et al., "MagMax: Leveraging Model Merging for Seamless Continual Learning",
ECCV 2024): per element, the task-vector entry of largest magnitude over all tasks so far,

    theta = theta_0 + lam * tau_{s*}[i],  s* = argmax_s |tau_s[i]|,

ties going to the later task (an arrival replaces the held entry when |tau_t[i]| >= |held[i]|).
Continual by construction: the state is the held entry per element (one model), every parameter
treated alike.

All-or-nothing `add`: the replacement masks of every parameter are computed first (one byte per
element, a quarter of the float32 state, freed on return), then written with `torch.where(...,
out=held)`, which allocates nothing and cannot fail part way. Snapshotting the state instead
would cost a whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from crucible.merge.base import DEFAULT_EXCLUDE, ContinualMerger, StateDict


class MagMax(ContinualMerger):
    """Element of largest magnitude over the task vectors so far; ties to the later task."""

    name = "magmax"

    def __init__(self, lam: float = 1.0, *, exclude: str | None = DEFAULT_EXCLUDE):
        super().__init__(exclude=exclude)
        self.lam = float(lam)
        self.best: dict[str, Tensor] = {}

    def _add(self, tv: StateDict) -> None:
        if not self.best:
            self.best = {k: v.clone() for k, v in tv.items()}
            return
        replace = {k: v.abs() >= self.best[k].abs() for k, v in tv.items()}
        for k, v in tv.items():
            held = self.best[k]
            torch.where(replace[k], v, held, out=held)

    def _delta(self, name: str) -> Tensor:
        return self.best[name] * self.lam

    def state_tensors(self) -> dict[str, Tensor]:
        return {f"best/{k}": v for k, v in self.best.items()}
