"""MagMax (Marczak et al., "MagMax: Leveraging Model Merging for Seamless Continual Learning",
ECCV 2024): per element, the task-vector entry of largest magnitude over all tasks so far,

    theta = theta_0 + lam * tau_{s*}[i],  s* = argmax_s |tau_s[i]|,

ties going to the later task (an arrival replaces the held entry when |tau_t[i]| >= |held[i]|).
Continual by construction: the state is the held entry per element (one model), every parameter
treated alike.
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
        for k, v in tv.items():
            if k not in self.best:
                self.best[k] = v.clone()
            else:
                held = self.best[k]
                held.copy_(torch.where(v.abs() >= held.abs(), v, held))

    def _delta(self, name: str) -> Tensor:
        return self.best[name] * self.lam

    def state_tensors(self) -> dict[str, Tensor]:
        return {f"best/{k}": v for k, v in self.best.items()}
