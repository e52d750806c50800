"""Stage `pseudolabel` (per task): teacher labels for the curated pool, with design-corrected
estimates of their quality (docs/methods.md, pseudolabel; crucible.pseudolabel).

    crucible stage pseudolabel --task bbc

Reads data/<task>/{reference,pool,audit,curated}.parquet, truth.parquet where present, and
embeddings.safetensors. Fits the teacher (a logistic-regression probe on the reference's
embeddings, temperature-scaled on a held-out part of the reference), labels every pooled item,
selects by confidence (`pseudolabel.selection`), and weights each item by its corrected membership
m_j (curate) times its confidence, clipped as crucible.pseudolabel.training_weights documents.
Audited members keep their true labels; audited non-members are dropped (weight 0).

Outputs:
- data/<task>/labeled.parquet: id, text, label, source (reference | audit | pseudo), confidence,
  weight. Reference rows have confidence 1 and weight 1; audited members confidence 1.
- metrics/<task>/pseudolabel.json: the estimates (accuracy on the clean pool, on the selection, the
  clean pool's class prior) with their intervals and, where the demo's truth covers the pool, the
  true values beside them (`*_true`).
- reports/<task>/pseudolabel_confusion.png and metrics/<task>/pseudolabel_confusion.csv (actual,
  predicted): pseudo-labels against the audit's true labels of audited members (`dvc plots`).
Bad input (a single-class reference, audit labels outside the reference's classes, an empty
selection) stops the stage with a ValueError; nothing is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from crucible import pseudolabel as pl
from tasks.data.audited import read_audited_task
from tasks.runtime.declaration import Plot, StageSpec
from tasks.runtime.io import AtomicOutputs, read_stage_output, read_table
from tasks.runtime.params_schema import Params

CURATED_COLUMNS = ("id", "score", "audited", "m")

SPEC = StageSpec(
    name="pseudolabel",
    per_task=True,
    comment="Per task: pseudo-labels for the kept pool items, their quality estimated against the audit.",
    deps=tuple(
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
    params=("pipeline.seed", "pseudolabel"),
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
    cfg = params.pseudolabel
    base = Path(root) / "data" / task
    data = read_audited_task(root, task)
    reference, pool, ref_x, pool_x = data.reference, data.pool, data.ref_x, data.pool_x
    curated = read_curated(base / "curated.parquet", pool)

    teacher = pl.fit_teacher(
        ref_x,
        reference["label"].to_numpy(dtype=object),
        holdout=cfg.holdout,
        C=cfg.C,
        seed=params.pipeline.seed,
        source=str(base / "reference.parquet"),
    )
    classes = teacher.classes
    pred = pl.predict(teacher, pool_x)

    audited, member, pi, audit_label = data.audited, data.member, data.pi, data.audit_label
    # an audit label outside the classes is an error only for a member (a non-member has none)
    y_audit = pl.label_indices(
        np.where(member == 1, audit_label, None),
        classes,
        source=f"{base / 'audit.parquet'}, column 'label' (pool order)",
    )

    selected = pl.select(pred, mode=cfg.selection, threshold=cfg.threshold, quota=cfg.quota)
    if not selected.any():
        raise ValueError(
            f"task '{task}': the pseudo-label selection is empty: no pooled item has calibrated "
            f"confidence >= pseudolabel.threshold = {cfg.threshold:g} (the largest is "
            f"{pred.confidence.max():.3f}); lower the threshold"
        )
    try:
        quality = pl.estimate_quality(
            pred,
            classes,
            curated["score"].to_numpy(dtype=np.float64),
            audited,
            member,
            y_audit,
            pi,
            selected,
            level=cfg.level,
        )
    except ValueError as exc:
        raise ValueError(f"task '{task}' ({base}): {exc}") from None
    m = curated["m"].to_numpy(dtype=np.float64)
    weight = pl.training_weights(m, pred.confidence, audited, member, w_max=cfg.w_max)

    label, is_member = pl.final_labels(pred.label, audited, member, y_audit)
    pseudo = selected & ~audited & (weight > 0)
    labels = np.array(classes, dtype=object)
    labeled = pd.concat(
        [
            pd.DataFrame(
                {
                    "id": reference["id"],
                    "text": reference["text"],
                    "label": reference["label"],
                    "source": "reference",
                    "confidence": 1.0,
                    "weight": 1.0,
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
                }
            ),
        ],
        ignore_index=True,
    )
    labeled["label"] = labeled["label"].astype(str)
    labeled["confidence"] = labeled["confidence"].astype(np.float64)
    labeled["weight"] = labeled["weight"].astype(np.float64)

    metrics: dict[str, float] = {_metric_key(k): float(v) for k, v in quality.to_dict().items()}
    truth = _truth_labels(root, task, pool)
    if truth is not None:
        true_member, true_label = truth
        y_true = pl.label_indices(
            np.where(true_member == 1, true_label, None),
            classes,
            source=f"{base / 'truth.parquet'}, column 'label' (pool order)",
        )
        metrics.update(
            {
                _metric_key(f"{k}_true"): v
                for k, v in pl.true_quality(pred, classes, true_member, y_true, selected).items()
            }
        )
        metrics["pseudo_precision_true"] = float(true_member[pseudo].mean()) if pseudo.any() else 0.0
    metrics.update(
        temperature=teacher.temperature,
        holdout_nll_uncalibrated=teacher.holdout_nll_uncalibrated,
        holdout_nll=teacher.holdout_nll,
        holdout_accuracy=teacher.holdout_accuracy,
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

    confusion = pd.DataFrame(
        {"actual": audit_label[is_member].astype(str), "predicted": labels[pred.label[is_member]].astype(str)}
    )
    with AtomicOutputs() as out:
        out.parquet(labeled, base / "labeled.parquet")
        out.json(metrics, Path(root) / "metrics" / task / "pseudolabel.json")
        out.file(
            Path(root) / "metrics" / task / "pseudolabel_confusion.csv", lambda p: confusion.to_csv(p, index=False)
        )
        out.bytes(
            plot_confusion(confusion["actual"].tolist(), confusion["predicted"].tolist(), classes, task),
            Path(root) / "reports" / task / "pseudolabel_confusion.png",
        )
    log.log_artifact(Path(root) / "reports" / task / "pseudolabel_confusion.png")
    log.log_artifact(Path(root) / "metrics" / task / "pseudolabel.json")
    return metrics
