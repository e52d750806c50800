"""Continual task arithmetic and running weight average.

Task arithmetic (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023):
    theta = theta_0 + lambda * sum_{s<=t} tau_s.
Weight average (model soup of the fine-tunes, Wortsman et al. 2022):
    theta = theta_0 + (1/t) sum_{s<=t} tau_s  (= mean_s theta_s).
Both are exact in the continual setting: the state is one running sum (or mean) per parameter,
the size of one model, whatever the number of tasks. Every parameter is treated alike.

All-or-nothing `add` at no memory cost: the first arrival builds the state in a new dict and
assigns it at the end; a later one updates it with in-place `add_` / `lerp_` on validated tensors
of the state's own shape, dtype and device, which allocate nothing and cannot fail part way.
"""

from __future__ import annotations

from torch import Tensor

from crucible.merge.base import DEFAULT_EXCLUDE, ContinualMerger, StateDict


class TaskArithmetic(ContinualMerger):
    """theta_0 + lam * sum of all task vectors so far. State: the running sum."""

    name = "task_arithmetic"

    def __init__(self, lam: float = 0.3, *, exclude: str | None = DEFAULT_EXCLUDE):
        super().__init__(exclude=exclude)
        self.lam = float(lam)
        self.total: dict[str, Tensor] = {}

    def _add(self, tv: StateDict) -> None:
        if not self.total:
            self.total = {k: v.clone() for k, v in tv.items()}
            return
        for k, v in tv.items():
            self.total[k].add_(v)

    def _delta(self, name: str) -> Tensor:
        return self.total[name] * self.lam

    def state_tensors(self) -> dict[str, Tensor]:
        return {f"sum/{k}": v for k, v in self.total.items()}


class WeightAverage(ContinualMerger):
    """theta_0 + mean of all task vectors so far (the uniform average of the fine-tuned models).

    State: the running mean, updated as mean += (tau_t - mean) / t (`lerp_`, in place).
    """

    name = "weight_average"

    def __init__(self, *, exclude: str | None = DEFAULT_EXCLUDE):
        super().__init__(exclude=exclude)
        self.mean: dict[str, Tensor] = {}

    def _add(self, tv: StateDict) -> None:
        if not self.mean:
            self.mean = {k: v.clone() for k, v in tv.items()}
            return
        weight = 1.0 / (self.num_tasks + 1)
        for k, v in tv.items():
            self.mean[k].lerp_(v, weight)

    def _delta(self, name: str) -> Tensor:
        return self.mean[name].clone()

    def state_tensors(self) -> dict[str, Tensor]:
        return {f"mean/{k}": v for k, v in self.mean.items()}
