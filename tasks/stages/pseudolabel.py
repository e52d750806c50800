"""Stage `pseudolabel` (per task): teacher labels for the curated pool, with design-corrected
estimates of their quality (docs/methods.md, pseudolabel; crucible.pseudolabel, tasks.data.teachers).

    crucible stage pseudolabel --task bbc

Reads data/<task>/{reference,pool,audit,curated}.parquet, truth.parquet where present, and
embeddings.safetensors. Splits the reference into training and dev rows (`dev_fraction`, stratified,
seeded; no stage trains on the dev rows). Fits the teacher (`pseudolabel.teacher`: a probe on the
base model's embeddings, the base model fine-tuned on the reference (self-training), or a probe on a
larger model's features) on the training rows, calibrates it by temperature scaling on the dev rows,
labels every pooled item, selects by calibrated confidence (`pseudolabel.selection`; by default the
most confident labels whose expected accuracy reaches `target_accuracy`), and weights each item by
its corrected membership m_j (curate) times its confidence, clipped as
crucible.pseudolabel.training_weights documents. Audited members keep their true labels; audited
non-members are dropped (weight 0).

Outputs:
- data/<task>/labeled.parquet: id, text, label, source (reference | audit | pseudo), confidence,
  weight, split (train | dev: the reference's dev rows). Reference rows have confidence 1 and weight
  1; audited members confidence 1.
- metrics/<task>/pseudolabel.json: the teacher's dev accuracy and calibration, the estimates
  (accuracy on the clean pool, on the selection, their difference `selection_gain`, the clean
  pool's class prior) with their intervals and, where the demo's truth covers the pool, the true
  values beside them (`*_true`).
- reports/<task>/pseudolabel_confusion.png and metrics/<task>/pseudolabel_confusion.csv (actual,
  predicted): pseudo-labels against the audit's true labels of audited members (`dvc plots`).
Bad input (a single-class reference, audit labels outside the reference's classes) stops the stage
with a ValueError; nothing is written. An empty selection is a warning: the fine-tune then trains on
the reference and the audited members.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from crucible import pseudolabel as pl
from tasks.data.audited import read_audited_task
from tasks.data.teachers import dev_mask, run_teacher
from tasks.runtime.declaration import Plot, StageSpec
from tasks.runtime.io import AtomicOutputs, read_stage_output, read_table
from tasks.runtime.params_schema import FinetuneParams, Params
from tasks.runtime.paths import BASE_MANIFEST
from tasks.runtime.tracking import say

CURATED_COLUMNS = ("id", "score", "audited", "m")

SPEC = StageSpec(
    name="pseudolabel",
    per_task=True,
    comment="Per task: pseudo-labels for the kept pool items, their quality estimated against the audit.",
    deps=(str(BASE_MANIFEST),)
    + tuple(
        f"data/{{task}}/{f}"
        for f in (
            "reference.parquet",
            "pool.parquet",
            "audit.parquet",
            "truth.parquet",
            "curated.parquet",
            "embeddings.safetensors",
        )
    ),
    # teacher: finetune trains the base model by the finetune recipe: its keys are read too (not
    # another method's options)
    params=("pipeline.seed", "pseudolabel", "model", "embed", *FinetuneParams.recipe_keys()),
    outs=("data/{task}/labeled.parquet",),
    metrics=("metrics/{task}/pseudolabel.json",),
    plots=(
        Plot("reports/{task}/pseudolabel_confusion.png"),
        Plot("metrics/{task}/pseudolabel_confusion.csv", x="predicted", y="actual", template="confusion"),
    ),
)


def read_curated(path: Path, pool: pd.DataFrame) -> pd.DataFrame:
    """curate's output, checked row for row against the pool it was computed from."""
    curated = read_stage_output(path, "curated", CURATED_COLUMNS, "curate")
    if curated["id"].tolist() != pool["id"].tolist():
        raise ValueError(f"{path}: rows do not match the pool's ids in order; rerun the curate stage (dvc repro)")
    for col in ("score", "m"):
        x = curated[col].to_numpy(dtype=np.float64)
        if not np.all(np.isfinite(x)):
            row = int(np.flatnonzero(~np.isfinite(x))[0])
            raise ValueError(f"{path}, column '{col}', row {row}: got {x[row]!r}; expected a finite number")
    return curated


def _truth_labels(root: Path, task: str, pool: pd.DataFrame):
    """The demo's (membership, label) aligned with the pool, or None when the truth does not cover it."""
    path = Path(root) / "data" / task / "truth.parquet"
    if not path.exists():
        return None
    truth = read_table(path, "truth").set_index("id")
    if not pool["id"].isin(truth.index).all():
        return None
    rows = truth.loc[pool["id"]]
    return rows["member"].to_numpy(dtype=np.float64), rows["label"].to_numpy(dtype=object)


def _metric_key(key: str) -> str:
    # MLflow metric names allow letters, digits, _ - . / and spaces; class labels may hold anything
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", key)


def plot_confusion(actual: list[str], predicted: list[str], classes, task: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.runtime.io import figure_png

    index = {c: i for i, c in enumerate(classes)}
    counts = np.zeros((len(classes), len(classes)), dtype=np.int64)
    for a, p in zip(actual, predicted):
        counts[index[a], index[p]] += 1
    size = 1.2 + 0.7 * len(classes)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    im = ax.imshow(counts, cmap="Blues")
    for i in range(len(classes)):
        for j in range(len(classes)):
            ax.text(
                j,
                i,
                str(counts[i, j]),
                ha="center",
                va="center",
                color="white" if counts[i, j] > counts.max() / 2 else "black",
            )
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set(
        xlabel="pseudo-label (teacher)",
        ylabel="true label (audit)",
        title=f"{task}: pseudo-labels vs audited members (n={len(actual)})",
    )
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return figure_png(fig)


def run(params: Params, task: str, root: Path, log) -> dict:
    """Read the task, run the teacher, select and weight its labels, estimate their quality, write, log."""
    data = read_inputs(params, task, root)
    teacher = run_teacher(
        params,
        root,
        task,
        data["reference"],
        data["dev"],
        data["audited"].pool,
        data["audited"].ref_x,
        data["audited"].pool_x,
        data["classes"],
        source=str(Path(root) / "data" / task / "reference.parquet"),
    )
    result = label_pool(params, task, root, data, teacher)
    write_outputs(root, task, result)
    log.log_params({f"teacher_{k}": v for k, v in teacher.info.items() if k != "seconds"})
    log.log_artifact(Path(root) / "reports" / task / "pseudolabel_confusion.png")
    log.log_artifact(Path(root) / "metrics" / task / "pseudolabel.json")
    return result["metrics"]


def read_inputs(params: Params, task: str, root: Path) -> dict:
    """The audited task (tables, embeddings, audit in pool order), curate's output, the classes and
    the reference's dev rows."""
    base = Path(root) / "data" / task
    data = read_audited_task(root, task)
    curated = read_curated(base / "curated.parquet", data.pool)
    labels = data.reference["label"].to_numpy(dtype=object)
    classes = tuple(sorted(set(labels.tolist())))
    if len(classes) < 2:
        raise ValueError(
            f"{base / 'reference.parquet'}, column 'label': every row has the class {classes[0]!r}; expected at "
            "least two classes"
        )
    dev = dev_mask(data.reference, params.pseudolabel.dev_fraction, params.pipeline.seed, task)
    return {"audited": data, "curated": curated, "classes": classes, "reference": data.reference, "dev": dev}


def label_pool(params: Params, task: str, root: Path, data: dict, teacher) -> dict:
    """Select by calibrated confidence, weight by corrected membership x confidence, estimate the
    quality on the audit; the labeled table, metrics and confusion rows."""
    cfg = params.pseudolabel
    base = Path(root) / "data" / task
    audit, classes, pred = data["audited"], data["classes"], teacher.pred
    # an audit label outside the classes is an error only for a member (a non-member has none)
    y_audit = pl.label_indices(
        np.where(audit.member == 1, audit.audit_label, None),
        classes,
        source=f"{base / 'audit.parquet'}, column 'label' (pool order)",
    )
    selected = pl.select(pred, mode=cfg.selection, threshold=cfg.threshold, quota=cfg.quota, target=cfg.target_accuracy)
    if not selected.any():
        say(
            f"warning: pseudolabel@{task}: no pseudo-label kept (selection {cfg.selection}; the most confident has "
            f"calibrated confidence {pred.confidence.max():.3f}): the fine-tune trains on the reference and audit"
        )
    try:
        quality = pl.estimate_quality(
            pred,
            classes,
            data["curated"]["score"].to_numpy(dtype=np.float64),
            audit.audited,
            audit.member,
            y_audit,
            audit.pi,
            selected,
            level=cfg.level,
        )
    except ValueError as exc:
        raise ValueError(f"task '{task}' ({base}): {exc}") from None
    m = data["curated"]["m"].to_numpy(dtype=np.float64)
    weight = pl.training_weights(m, pred.confidence, audit.audited, audit.member, w_max=cfg.w_max)
    label, is_member = pl.final_labels(pred.label, audit.audited, audit.member, y_audit)
    pseudo = selected & ~audit.audited & (weight > 0)
    labeled = labeled_table(data["reference"], data["dev"], audit.pool, classes, label, is_member, pseudo, pred, weight)
    metrics = quality_metrics(root, task, audit.pool, classes, quality, pred, selected, pseudo, is_member)
    metrics.update(
        {f"teacher_{k}": v for k, v in teacher.info.items() if isinstance(v, (int, float)) and k != "seconds"},
        **teacher.calibration.to_dict(),
        threshold_used=float(pred.confidence[selected].min()) if selected.any() else None,
        expected_selected_accuracy=float(pred.confidence[selected].mean()) if selected.any() else None,
        naive_accuracy=float(pred.confidence.mean()),
        n_selected=int(selected.sum()),
        n_pseudo=int(pseudo.sum()),
        n_audit_members=int(is_member.sum()),
        n_labeled=len(labeled),
        n_weight_clipped_low=int((m < 0).sum()),
        n_weight_clipped_high=int((m > cfg.w_max).sum()),
        pseudo_weight_sum=float(weight[pseudo].sum()),
        audit_confusion_accuracy=float((pred.label[is_member] == y_audit[is_member]).mean())
        if is_member.any()
        else 0.0,
    )
    labels = np.array(classes, dtype=object)
    confusion = pd.DataFrame(
        {"actual": audit.audit_label[is_member].astype(str), "predicted": labels[pred.label[is_member]].astype(str)}
    )
    return {"labeled": labeled, "metrics": metrics, "confusion": confusion, "classes": classes}


def labeled_table(reference, dev, pool, classes, label, is_member, pseudo, pred, weight) -> pd.DataFrame:
    """labeled.parquet: the reference (split train or dev), the audited members (their true labels)
    and the kept pseudo-labels, with their confidence and training weight."""
    labels = np.array(classes, dtype=object)
    parts = [
        pd.DataFrame(
            {
                "id": reference["id"],
                "text": reference["text"],
                "label": reference["label"],
                "source": "reference",
                "confidence": 1.0,
                "weight": 1.0,
                "split": np.where(dev, "dev", "train"),
            }
        ),
        pd.DataFrame(
            {
                "id": pool["id"][is_member],
                "text": pool["text"][is_member],
                "label": labels[label[is_member]],
                "source": "audit",
                "confidence": 1.0,
                "weight": weight[is_member],
                "split": "train",
            }
        ),
        pd.DataFrame(
            {
                "id": pool["id"][pseudo],
                "text": pool["text"][pseudo],
                "label": labels[label[pseudo]],
                "source": "pseudo",
                "confidence": pred.confidence[pseudo],
                "weight": weight[pseudo],
                "split": "train",
            }
        ),
    ]
    labeled = pd.concat(parts, ignore_index=True)
    labeled["label"] = labeled["label"].astype(str)
    labeled["confidence"] = labeled["confidence"].astype(np.float64)
    labeled["weight"] = labeled["weight"].astype(np.float64)
    return labeled


def quality_metrics(root, task, pool, classes, quality, pred, selected, pseudo, is_member) -> dict:
    """The design-corrected estimates and, where the demo's truth covers the pool, the true values."""
    metrics: dict = {_metric_key(k): float(v) for k, v in quality.to_dict().items()}
    if quality.selected_accuracy is not None:
        metrics["selection_gain"] = quality.selected_accuracy.value - quality.accuracy.value
    truth = _truth_labels(root, task, pool)
    if truth is not None:
        true_member, true_label = truth
        y_true = pl.label_indices(
            np.where(true_member == 1, true_label, None),
            classes,
            source=f"{Path(root) / 'data' / task / 'truth.parquet'}, column 'label' (pool order)",
        )
        true = pl.true_quality(pred, classes, true_member, y_true, selected)
        metrics.update({_metric_key(f"{k}_true"): v for k, v in true.items()})
        metrics["pseudo_precision_true"] = float(true_member[pseudo].mean()) if pseudo.any() else 0.0
    return metrics


def write_outputs(root: Path, task: str, result: dict) -> None:
    base, metrics = Path(root) / "data" / task, Path(root) / "metrics" / task
    confusion = result["confusion"]
    with AtomicOutputs() as out:
        out.parquet(result["labeled"], base / "labeled.parquet")
        out.json(result["metrics"], metrics / "pseudolabel.json")
        out.file(metrics / "pseudolabel_confusion.csv", lambda p: confusion.to_csv(p, index=False))
        out.bytes(
            plot_confusion(confusion["actual"].tolist(), confusion["predicted"].tolist(), result["classes"], task),
            Path(root) / "reports" / task / "pseudolabel_confusion.png",
        )
