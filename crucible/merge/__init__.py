"""Continual model merging: task vectors arrive one at a time; each merger holds only its state.

    from crucible.merge import make_merger, merge_sequence, task_vector
    merger = make_merger("gs3r", energy=0.9, rank_budget=0.5)
    tvs = (task_vector(load(p), theta_0, source=p) for p in finetuned_paths)  # lazy, one at a time
    for t, merged in enumerate(merge_sequence(theta_0, tvs, merger)):
        evaluate(merged)                                                      # forgetting curve

Methods (one file each): task_arithmetic, weight_average (arithmetic.py), ties (ties.py), magmax
(magmax.py), opcm (opcm.py), gs3r (gs3r.py). The shared contract is `ContinualMerger` (base.py).
State dicts map parameter names to float tensors (e.g. a Hugging Face encoder's state_dict or a
safetensors file of the same keys); heads are task-specific and are not merged here.
`task_vector`, `ContinualMerger.add` and `.merged` refuse a NaN or inf, or keys and shapes that do
not match, with a ValueError naming the parameter (and the `source` file when given); a refused or
failed `add` leaves the merger exactly as it was.
"""

from __future__ import annotations

from crucible.merge.arithmetic import TaskArithmetic, WeightAverage
from crucible.merge.base import DEFAULT_EXCLUDE, ContinualMerger, energy_rank, global_norm, merge_sequence, task_vector
from crucible.merge.gs3r import GS3R
from crucible.merge.magmax import MagMax
from crucible.merge.opcm import OPCM
from crucible.merge.ties import TIES

MERGERS: dict[str, type[ContinualMerger]] = {
    cls.name: cls for cls in (TaskArithmetic, WeightAverage, TIES, MagMax, OPCM, GS3R)
}


def make_merger(name: str, **kwargs) -> ContinualMerger:
    """A fresh merger by method name (keys of MERGERS) with its keyword arguments.

    Raises ValueError for an unknown name; TypeError for an unknown argument of that method.
    """
    if name not in MERGERS:
        raise ValueError(f"unknown merge method {name!r}; valid: {sorted(MERGERS)}")
    return MERGERS[name](**kwargs)


__all__ = [
    "ContinualMerger",
    "DEFAULT_EXCLUDE",
    "GS3R",
    "MERGERS",
    "MagMax",
    "OPCM",
    "TIES",
    "TaskArithmetic",
    "WeightAverage",
    "energy_rank",
    "global_norm",
    "make_merger",
    "merge_sequence",
    "task_vector",
]
