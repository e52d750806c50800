"""Refitting task heads on a changed encoder (docs/methods.md, value): merging and quantizing move
an encoder's features, and each task's head was trained on its own fine-tune's. A head refitted on
the new encoder's features of the task's training reference rows (crucible.heads.fit_linear_head,
C by cross-validation) is cheap: the merge and quantize stages already keep those features (the
probe rows, tasks.data.heldout_scoring.FeatureStore). Whether the refit is deployed is decided on
the dev rows (`refit_heads`: auto keeps the refit only where it is more accurate on them; always;
never); nothing is fitted on the dev rows or chosen on the test rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from crucible.heads import fit_linear_head
from crucible.seeding import derive_seed
from tasks.runtime.io import read_stage_output


def dev_ids(root: Path, tasks: list[str]) -> dict[str, set]:
    """Per task the ids of the reference's dev rows (labeled.parquet, split == dev)."""
    out = {}
    for t in tasks:
        labeled = read_stage_output(
            Path(root) / "data" / t / "labeled.parquet", "labeled", ("id", "split"), "pseudolabel"
        )
        out[t] = set(labeled.loc[labeled["split"] == "dev", "id"].tolist())
    return out


def refit_heads(
    store, variant: str, heads: dict, probe_ids: dict[str, list], dev: dict[str, set], mode: str, seed: int
) -> tuple[dict, dict]:
    """(heads, report): for each task, the head `variant`'s features are read through, refitted on
    its training probe rows when `mode` says so. heads: {task: (weight, bias)} tensors; probe_ids:
    the ids of the store's probe rows per task, in row order; dev: the dev ids per task. The report
    has per task the dev accuracy of the kept and the refitted head, the C chosen and whether the
    refit was taken."""
    out, report = {}, {}
    for t, (weight, bias) in heads.items():
        x = store.tensors[f"{variant}/{t}/probe"].numpy()
        y = store.tensors[f"labels/{t}/probe"].numpy()
        is_dev = np.array([i in dev[t] for i in probe_ids[t]], dtype=bool)
        if mode == "never" or not is_dev.any() or is_dev.all() or len(np.unique(y[~is_dev])) < 2:
            out[t] = (weight, bias)
            report[t] = {"refit": False, "reason": "refit_heads: never" if mode == "never" else "no dev split"}
            continue
        head = fit_linear_head(x[~is_dev], y[~is_dev], weight.shape[0], seed=derive_seed(seed, t, "refit"))
        kept = float((np.argmax(x[is_dev] @ weight.numpy().T + bias.numpy(), axis=1) == y[is_dev]).mean())
        refit = float((head.predict(x[is_dev]) == y[is_dev]).mean())
        take = mode == "always" or refit > kept
        out[t] = (torch.from_numpy(head.weight), torch.from_numpy(head.bias)) if take else (weight, bias)
        report[t] = {
            "refit": take,
            "dev_accuracy_kept": kept,
            "dev_accuracy_refit": refit,
            "C": head.C,
            "n_fit": int((~is_dev).sum()),
            "n_dev": int(is_dev.sum()),
        }
    return out, report
