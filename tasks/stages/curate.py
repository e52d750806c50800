"""Stage `curate` (per task): CC-MMD between the reference and the clean part of the pool, as a
data-quality measure with its interval, and the corrected per-item weights.

    crucible stage curate --task bbc

Reads data/<task>/{reference,pool,audit}.parquet and embeddings.safetensors (stage `embed`), scores
every pooled item with a proxy membership score (params `curate.scorer`), computes CC-MMD^2 with a
delta-method interval beside the naive (every item clean) and audit-only estimates and
eps_hat = 1 - N_hat / n (crucible.ccmmd; docs/methods.md, curate). Where the demo's truth covers the pool,
the oracle and the true eps are reported beside them.

Outputs: data/<task>/curated.parquet (id, text, score, audited, m, keep), metrics/<task>/curate.json
(metrics), reports/<task>/curate.png (scores by true membership where known; the estimates with the interval).
A gate (`curate.gate_max_ccmmd`) fails the stage, writing nothing, when the interval's lower end
exceeds the threshold: the pool's clean part does not match the reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from crucible.ccmmd import GaussianKernel, cc_mmd
from crucible.membership_scores import domain_classifier_scores, knn_density_ratio_scores
from tasks.data.audited import read_audited_task
from tasks.runtime.declaration import Plot, StageSpec
from tasks.runtime.device import current
from tasks.runtime.io import AtomicOutputs, read_table
from tasks.runtime.params_schema import Params

SPEC = StageSpec(
    name="curate",
    per_task=True,
    comment="Per task: CC-MMD between the pool and the reference, corrected by the audit; each pooled "
    "item's corrected membership.",
    deps=tuple(
        f"data/{{task}}/{f}"
        for f in ("reference.parquet", "pool.parquet", "audit.parquet", "truth.parquet", "embeddings.safetensors")
    ),
    params=("pipeline.seed", "curate"),
    outs=("data/{task}/curated.parquet",),
    metrics=("metrics/{task}/curate.json",),
    plots=(Plot("reports/{task}/curate.png"),),
)


class DataQualityGateError(RuntimeError):
    pass


def proxy_scores(params: Params, ref: np.ndarray, pool: np.ndarray, pool_df: pd.DataFrame, source: str) -> np.ndarray:
    cfg = params.curate
    if cfg.scorer == "domain_classifier":
        return domain_classifier_scores(ref, pool, folds=cfg.folds, seed=params.pipeline.seed)
    if cfg.scorer == "knn":
        return knn_density_ratio_scores(ref, pool, k=cfg.knn_k)
    if "score" not in pool_df.columns:
        raise ValueError(
            f"{source}: curate.scorer is 'column' but the pool has no 'score' column "
            f"(columns: {list(pool_df.columns)}); use scorer domain_classifier or knn"
        )
    return pool_df["score"].to_numpy(dtype=np.float64)


def _truth_membership(root: Path, task: str, pool: pd.DataFrame) -> np.ndarray | None:
    """The demo's true membership aligned with the pool, or None when the truth does not cover it."""
    path = Path(root) / "data" / task / "truth.parquet"
    if not path.exists():
        return None
    truth = read_table(path, "truth").set_index("id")
    if not pool["id"].isin(truth.index).all():
        return None
    return truth.loc[pool["id"], "member"].to_numpy(dtype=np.float64)


def plot(scores: np.ndarray, truth: np.ndarray | None, result, task: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.runtime.io import figure_png

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    bins = np.linspace(0, 1, 26)
    if truth is not None:
        a.hist(scores[truth == 1], bins=bins, alpha=0.6, label="target (truth)")
        a.hist(scores[truth == 0], bins=bins, alpha=0.6, label="contaminant (truth)")
        a.legend()
    else:
        a.hist(scores, bins=bins)
    a.set(title=f"{task}: proxy membership scores", xlabel="score s_j", ylabel="pool items")
    names = ["naive", "audit-only", "CC-MMD"]
    values = [result.naive, result.audit_only, result.value]
    b.bar(names, values, color=["#bbbbbb", "#9ecae1", "#3182bd"])
    b.errorbar(
        [2],
        [result.value],
        yerr=[[result.value - result.ci_low], [result.ci_high - result.value]],
        fmt="none",
        ecolor="black",
        capsize=6,
        label=f"{result.level:.0%} interval",
    )
    if result.oracle is not None:
        b.axhline(result.oracle, color="crimson", linestyle="--", label="oracle (truth)")
    b.set(title="MMD^2 to the reference", ylabel="MMD^2")
    b.legend()
    fig.tight_layout()
    return figure_png(fig)


def run(params: Params, task: str, root: Path, log) -> dict:
    """Read the audited task, score the pool, estimate CC-MMD and the corrected weights, gate, write, log."""
    data = read_audited_task(root, task)
    scores = proxy_scores(params, data.ref_x, data.pool_x, data.pool, str(Path(root) / "data" / task / "pool.parquet"))
    truth = _truth_membership(root, task, data.pool)
    result = estimate(params, task, root, data, scores, truth)
    metrics, keep = curation_metrics(params, result, scores, truth)
    check_gate(params, task, result)
    write_outputs(root, task, data, scores, truth, result, keep, metrics)
    log.log_artifact(Path(root) / "reports" / task / "curate.png")
    log.log_artifact(Path(root) / "metrics" / task / "curate.json")
    return metrics


def estimate(params: Params, task: str, root: Path, data, scores, truth):
    """CC-MMD between the reference and the pool's clean part (crucible.ccmmd), on the run's device (on
    CUDA the exact kernel sums run through the Triton kernel)."""
    cfg = params.curate
    kernel = GaussianKernel(
        bandwidths=tuple(cfg.bandwidths) if cfg.bandwidths else None,
        scales=tuple(cfg.bandwidth_scales),
        seed=params.pipeline.seed,
    )
    device = current().device
    try:
        return cc_mmd(
            torch.from_numpy(data.ref_x).float().to(device),
            torch.from_numpy(data.pool_x).float().to(device),
            scores,
            data.audited.astype(np.float64),
            data.member,
            data.pi,
            kernel=kernel,
            truth=truth,
            method=cfg.method,
            n_features=cfg.rff_features,
            seed=params.pipeline.seed,
            level=cfg.level,
        )
    except ValueError as exc:
        raise ValueError(f"task '{task}' ({Path(root) / 'data' / task}): {exc}") from None


def curation_metrics(params: Params, result, scores, truth) -> tuple[dict, np.ndarray]:
    """(curate.json's metrics, the kept items m_j > keep_threshold); with the demo's truth, the true
    contamination, the proxy score's AUC and the kept items' precision and recall beside."""
    keep = result.weights.cpu().numpy() > params.curate.keep_threshold
    metrics = {
        f"ccmmd_{k}" if k in ("value", "se", "ci_low", "ci_high") else k: v
        for k, v in result.to_dict().items()
        if k not in ("bandwidths", "method", "level")
    }
    metrics.update(n_keep=int(keep.sum()), keep_fraction=float(keep.mean()), bandwidth=float(result.bandwidths[0]))
    if truth is not None:
        from sklearn.metrics import roc_auc_score

        metrics.update(
            eps_true=float(1 - truth.mean()),
            score_auc=float(roc_auc_score(truth, scores)),
            keep_precision=float(truth[keep].mean()) if keep.any() else 0.0,
            keep_recall=float(keep[truth == 1].mean()),
        )
    return metrics, keep


def check_gate(params: Params, task: str, result) -> None:
    """The data-quality gate (curate.gate_max_ccmmd): the interval's lower end above it stops the run."""
    cfg = params.curate
    if cfg.gate_max_ccmmd is not None and result.ci_low > cfg.gate_max_ccmmd:
        raise DataQualityGateError(
            f"task '{task}': data-quality gate failed: CC-MMD^2 = {result.value:.4g} with {cfg.level:.0%} interval "
            f"[{result.ci_low:.4g}, {result.ci_high:.4g}] lies above curate.gate_max_ccmmd = {cfg.gate_max_ccmmd:g} "
            f"(naive {result.naive:.4g}, audit-only {result.audit_only:.4g}, eps_hat {result.eps_hat:.3f}): "
            "the clean part of the pool does not match the reference"
        )


def write_outputs(root: Path, task: str, data, scores, truth, result, keep, metrics: dict) -> None:
    curated = pd.DataFrame(
        {
            "id": data.pool["id"],
            "text": data.pool["text"],
            "score": scores,
            "audited": data.audited.astype(np.int8),
            "m": result.weights.cpu().numpy(),
            "keep": keep,
        }
    )
    with AtomicOutputs() as out:
        out.parquet(curated, Path(root) / "data" / task / "curated.parquet")
        out.json(metrics, Path(root) / "metrics" / task / "curate.json")
        out.bytes(plot(scores, truth, result, task), Path(root) / "reports" / task / "curate.png")
