"""The value of a run (docs/methods.md, value): the two deployable models (the float merged encoder
and the quantized one, each with its deployed heads) against what a user gets without crucible (a
logistic-regression probe on the frozen base model's embeddings, fitted on the task's labeled
reference rows, C by cross-validation) and against each task's own fine-tune, row by row on every
test row. Every difference carries its paired-bootstrap interval and exact McNemar p-value
(crucible.stats); the mean over tasks, its interval from a bootstrap stratified by task.

The steps from a task's fine-tune to the deployed model show where accuracy goes:
finetune -> merged (the merged encoder with the fine-tune's own head) -> float (with the deployed,
possibly refitted, head) -> quantized (MXFP4 with compensation, its deployed head).

Models, each a column of the predictions table (predicted labels; the test rows in test.parquet's
order): probe, finetune, merged, float, quantized.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd

from crucible.heads import fit_probe_cv
from crucible.seeding import derive_seed
from crucible.stats import compare_tasks, normalised_accuracy
from tasks.data.embeddings import load_embeddings
from tasks.runtime.io import read_table

MODELS = ("probe", "finetune", "merged", "float", "quantized")
# (A, B) pairs compared row by row: A - B
COMPARISONS = (
    ("quantized", "probe"),
    ("float", "probe"),
    ("finetune", "probe"),
    ("quantized", "finetune"),
    ("float", "finetune"),
    ("merged", "finetune"),
    ("float", "merged"),
    ("quantized", "float"),
)


def probe_baseline(root: Path, task: str, seed: int) -> tuple[np.ndarray, dict]:
    """(predicted labels on the task's test rows, {C, cv_accuracy, n_fit}): the frozen-base probe
    fitted on every labeled reference row's embedding (the embed stage's), C by cross-validation."""
    base = Path(root) / "data" / task
    frames = {
        "reference": read_table(base / "reference.parquet", "reference"),
        "test": read_table(base / "test.parquet", "test"),
    }
    emb = load_embeddings(root, task, frames)
    labels = frames["reference"]["label"].to_numpy(dtype=object)
    fit = fit_probe_cv(emb["reference"].double().numpy(), labels, seed=seed)
    pred = fit.probe.predict(emb["test"].double().numpy())
    return pred.astype(str), {"C": fit.C, "cv_accuracy": round(fit.cv_accuracy, 6), "n_fit": len(labels)}


def _head_predict(features, heads: dict, task: str, classes: list[str]) -> np.ndarray:
    w, b = heads[f"{task}.weight"].double().numpy(), heads[f"{task}.bias"].double().numpy()
    return np.asarray(classes, dtype=object)[np.argmax(features.double().numpy() @ w.T + b, axis=1)].astype(str)


def text_md5(texts) -> list[str]:
    return [hashlib.md5(str(t).encode()).hexdigest() for t in texts]


def predictions(root: Path, data: dict, main: str, quantized_variant: str, seed: int) -> tuple[pd.DataFrame, dict]:
    """(the predictions table: task, row, id, text_md5, label and one column per model of MODELS, all
    labels as strings; the probe baselines' fits). data: evaluate's inputs (tensors of both stages,
    the classes, the task heads and the deployed heads)."""
    T, order = data["tensors"], data["order"]
    last = f"{main}@{len(order) - 1}"
    frames, fits = [], {}
    for t in order:
        classes = list(data["classes"][t])
        labels = np.asarray(classes, dtype=object)[T[f"labels/{t}/test"].numpy()].astype(str)
        test = read_table(Path(root) / "data" / t / "test.parquet", "test")
        if len(test) != len(labels) or (test["label"].astype(str).to_numpy() != labels).any():
            raise ValueError(
                f"{Path(root) / 'data' / t / 'test.parquet'}: its {len(test)} rows are not the {len(labels)} rows the "
                f"features were computed on; rerun merge and quantize (dvc repro)"
            )
        probe, fits[t] = probe_baseline(root, t, derive_seed(seed, t, "baseline"))
        heads, deploy = data["heads"], data["deploy_heads"]
        cols = {
            "probe": probe,
            "finetune": _head_predict(T[f"finetune:{t}/{t}/test"], heads, t, classes),
            "merged": _head_predict(T[f"{last}/{t}/test"], heads, t, classes),
            "float": _head_predict(T[f"{last}/{t}/test"], deploy["float"], t, classes),
            "quantized": _head_predict(T[f"quantize:{quantized_variant}/{t}/test"], deploy["quantized"], t, classes),
        }
        for name, pred in cols.items():
            if len(pred) != len(labels):
                raise ValueError(f"model {name!r}, task {t!r}: {len(pred)} predictions for {len(labels)} test rows")
        frames.append(
            pd.DataFrame(
                {
                    "task": t,
                    "row": np.arange(len(labels)),
                    "id": test["id"].astype(str).to_numpy(),
                    "text_md5": text_md5(test["text"]),
                    "label": labels,
                    **cols,
                }
            )
        )
    return pd.concat(frames, ignore_index=True), fits


def outcomes(preds: pd.DataFrame, model: str) -> dict[str, np.ndarray]:
    """Per task, the model's row outcomes (True where it predicts the label)."""
    return {t: (g[model] == g["label"]).to_numpy() for t, g in preds.groupby("task", sort=False)}


def value(preds: pd.DataFrame, *, level: float, n_boot: int, seed: int) -> dict:
    """Accuracy per model and task (and mean), every comparison of COMPARISONS per task and over the
    task mean with its interval, and the normalised accuracy of each deployable model against the
    fine-tunes (mean over tasks of acc / acc of the task's fine-tune) with its interval."""
    out = {m: outcomes(preds, m) for m in MODELS}
    accuracy = {m: {t: float(o.mean()) for t, o in by.items()} for m, by in out.items()}
    for m in accuracy:
        accuracy[m]["mean"] = float(np.mean(list(accuracy[m].values())))
    comparisons = {}
    for k, (a, b) in enumerate(COMPARISONS):
        pairs = {t: (out[a][t], out[b][t]) for t in out[a]}
        comparisons[f"{a}_vs_{b}"] = {
            t: c.to_dict()
            for t, c in compare_tasks(pairs, level=level, n_boot=n_boot, seed=derive_seed(seed, k)).items()
        }
    normalised = {}
    for m in ("quantized", "float"):
        try:
            v, lo, hi = normalised_accuracy(
                {t: (out[m][t], out["finetune"][t]) for t in out[m]},
                level=level,
                n_boot=n_boot,
                seed=derive_seed(seed, m),
            )
        except ValueError:  # a fine-tune right on no row: no ratio to it
            normalised[m] = None
            continue
        normalised[m] = {"value": round(v, 6), "ci_low": round(lo, 6), "ci_high": round(hi, 6)}
    n = {t: int(len(o)) for t, o in out["probe"].items()}
    return {"level": level, "n_test": n, "accuracy": accuracy, "comparisons": comparisons, "normalised": normalised}
