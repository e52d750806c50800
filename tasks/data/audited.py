"""The inputs every audit-aware stage reads: the task's tables, its embeddings, and the audit laid
out in pool order (I_j, M_j, pi_j and the audited label), validated once, in one place: each
table's contract, a reference of at least two classes, reference and pool ids disjoint, every
audited id in the pool (crucible.schema)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from crucible.schema import validate_audit_against_pool, validate_disjoint, validate_reference_classes
from tasks.data.embeddings import load_embeddings
from tasks.runtime.io import read_table


@dataclass
class AuditedTask:
    reference: pd.DataFrame
    pool: pd.DataFrame
    audit: pd.DataFrame
    ref_x: np.ndarray  # (m, d) float64 reference embeddings
    pool_x: np.ndarray  # (n, d) float64 pool embeddings
    audited: np.ndarray  # (n,) bool, I_j
    member: np.ndarray  # (n,) float64, M_j where audited, 0 elsewhere
    pi: np.ndarray  # (n,) float64, pi_j where audited, 1 elsewhere (never read there)
    audit_label: np.ndarray  # (n,) object, the annotator's label where audited, None elsewhere


def read_audited_task(root: Path, task: str) -> AuditedTask:
    base = Path(root) / "data" / task
    reference = read_table(base / "reference.parquet", "reference")
    pool = read_table(base / "pool.parquet", "pool")
    audit = read_table(base / "audit.parquet", "audit")
    validate_reference_classes(reference, str(base / "reference.parquet"))
    validate_disjoint(
        {"reference": reference, "pool": pool},
        {"reference": str(base / "reference.parquet"), "pool": str(base / "pool.parquet")},
    )
    validate_audit_against_pool(audit, pool, str(base / "audit.parquet"))
    emb = load_embeddings(root, task, {"reference": reference, "pool": pool})
    rows = audit.set_index("id")
    audited = pool["id"].isin(rows.index).to_numpy()
    rows = rows.loc[pool["id"][audited]]
    member, pi = np.zeros(len(pool)), np.ones(len(pool))
    audit_label = np.full(len(pool), None, dtype=object)
    member[audited] = rows["member"].to_numpy(dtype=np.float64)
    pi[audited] = rows["pi"].to_numpy(dtype=np.float64)
    audit_label[audited] = rows["label"].to_numpy(dtype=object)
    return AuditedTask(
        reference,
        pool,
        audit,
        emb["reference"].double().numpy(),
        emb["pool"].double().numpy(),
        audited,
        member,
        pi,
        audit_label,
    )
