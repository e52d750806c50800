"""Stage `ingest` (per task): the four tables of the data contract, from real corpora or your files.

    crucible stage ingest --task bbc          # what dvc.yaml runs
    python -m tasks.stages.ingest --task bbc         # the same

source: demo builds, from the task's packaged corpus (tasks/data/corpora.py), a labeled `reference`, a
clean `test`, and a `pool` that mixes held-out target items with contaminants at rate eps (other
corpora, boilerplate, near-duplicates, word-shuffled items; crucible.contamination). The `audit` is a
Poisson draw with inclusion probability pi uniform or proportional to the proxy score's uncertainty
s(1 - s) with a floor; a simulated annotator answers membership, and the label of members, from
the held-back truth, which is written to its own file (`truth.parquet`, for evaluation only).
source: files reads <files_dir>/<task>/{reference,pool,audit,test}.parquet (and truth.parquet if
present), validates them and publishes them in the same place.

Either way the tables are checked before anything is written (`check_tables`): each table's
contract, a reference of at least two classes, no id in two of reference, pool and test and no test
text copied exactly in the reference or the pool (train/test leakage; `ingest.allow_shared_ids`
accepts ids shared with test, for files whose ids number rows), every audited id in the pool, and
audit and test labels among the reference's classes. A failed check writes nothing.

Outputs, under data/<task>/: reference, pool, audit, test, truth (.parquet); metrics/<task>/ingest.json.
The same params give byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from crucible.contamination import build_pool, draw_poisson_sample, poisson_inclusion_probabilities
from crucible.schema import (
    DataValidationError,
    validate_audit_against_pool,
    validate_disjoint,
    validate_labels_against_reference,
    validate_reference_classes,
    validate_table,
)
from crucible.seeding import numpy_rng
from tasks.data.corpora import load_corpus
from tasks.runtime.declaration import StageSpec
from tasks.runtime.io import AtomicOutputs, read_table
from tasks.runtime.params_schema import Params
from tasks.runtime.tracking import say

TABLES = ("reference", "pool", "audit", "test")

SPEC = StageSpec(
    name="ingest",
    per_task=True,
    comment="Per task: the four tables (reference, pool, audit, test) and the demo's held-back truth.",
    deps=("inputs",),
    # every task's spec: the demo mixes the other tasks' corpora into this task's pool
    params=("pipeline.seed", "pipeline.tasks", "ingest"),
    outs=tuple(f"data/{{task}}/{t}.parquet" for t in (*TABLES, "truth")),
    metrics=("metrics/{task}/ingest.json",),
)


def task_dir(root: Path, task: str) -> Path:
    return Path(root) / "data" / task


def task_rng(params: Params, task: str, purpose: str) -> np.random.Generator:
    """A generator per (seed, task, purpose): stable across runs and independent of task order."""
    return numpy_rng(params.pipeline.seed, task, purpose)


def _lexical_scores(reference: pd.DataFrame, pool: pd.DataFrame, seed: int) -> np.ndarray:
    from sklearn.feature_extraction.text import HashingVectorizer

    from crucible.membership_scores import domain_classifier_scores

    vec = HashingVectorizer(n_features=2**18, ngram_range=(1, 2), alternate_sign=False, norm="l2")
    return domain_classifier_scores(vec.transform(reference["text"]), vec.transform(pool["text"]), folds=2, seed=seed)


def build_demo(params: Params, task: str) -> dict[str, pd.DataFrame]:
    """The demo tables of one task (pure given params and the installed corpora)."""
    ing = params.ingest
    spec = params.pipeline.tasks[task]
    n_ref, n_pool, n_test = params.task_sizes(task)
    corpus = load_corpus(spec.corpus)
    corpus = corpus[corpus["text"].str.len() >= ing.min_chars].copy()
    corpus["text"] = corpus["text"].str.slice(0, ing.max_chars)
    # the corpus is deduplicated, but two texts that differ only past max_chars become one: keep it
    # once (dropped if its copies disagree on the label), or it could land in both test and pool
    labels_per_text = corpus.groupby("text")["label"].nunique()
    corpus = corpus[corpus["text"].map(labels_per_text) == 1].drop_duplicates("text")
    if n_ref + n_test >= len(corpus):
        raise ValueError(
            f"task '{task}': corpus '{spec.corpus}' has {len(corpus)} usable items, not enough for "
            f"n_reference={n_ref} + n_test={n_test} and a pool; lower them in params.yaml"
        )
    rng = task_rng(params, task, "split")
    order = rng.permutation(len(corpus))
    reference = corpus.iloc[order[:n_ref]]
    test = corpus.iloc[order[n_ref : n_ref + n_test]]
    held_out = corpus.iloc[order[n_ref + n_test :]]
    if reference["label"].nunique() < 2:
        raise DataValidationError(
            f"data/{task}/reference.parquet",
            "label",
            None,
            reference["label"].iat[0],
            "at least two classes",
            message=f"task '{task}': data/{task}/reference.parquet, column 'label': the demo drew {n_ref} rows of "
            f"corpus '{spec.corpus}', all of the single class {reference['label'].iat[0]!r}; expected at "
            f"least two classes: raise pipeline.tasks.{task}.n_reference (or ingest.n_reference)",
        )

    others = []
    for name in sorted({s.corpus for s in params.pipeline.tasks.values()} - {spec.corpus}):
        other = load_corpus(name)
        other = other[other["text"].str.len() >= ing.min_chars]
        others.append(pd.DataFrame({"text": other["text"].str.slice(0, ing.max_chars), "corpus": name}))
    others = pd.concat(others, ignore_index=True) if others else pd.DataFrame({"text": [], "corpus": []})
    try:
        pool, truth = build_pool(
            held_out,
            others,
            n_pool=n_pool,
            eps=ing.eps,
            mix=ing.contaminants.model_dump(),
            rng=task_rng(params, task, "pool"),
            id_prefix=f"{task}-p",
        )
    except ValueError as exc:
        raise ValueError(f"task '{task}' (corpus '{spec.corpus}', {len(corpus)} usable items): {exc}") from None

    reference = pd.DataFrame(
        {
            "id": [f"{task}-r{i:06d}" for i in range(n_ref)],
            "text": reference["text"].to_numpy(),
            "label": reference["label"].to_numpy(),
        }
    )
    test = pd.DataFrame(
        {
            "id": [f"{task}-t{i:06d}" for i in range(n_test)],
            "text": test["text"].to_numpy(),
            "label": test["label"].to_numpy(),
        }
    )

    uncertainty = None
    if ing.proxy_score == "lexical":
        pool["score"] = _lexical_scores(reference, pool, seed=params.pipeline.seed)
    if ing.audit.design == "uncertainty":
        if "score" not in pool:
            raise ValueError("ingest.audit.design = 'uncertainty' needs a proxy score; set ingest.proxy_score: lexical")
        s = pool["score"].to_numpy()
        uncertainty = s * (1.0 - s)
    pi = poisson_inclusion_probabilities(n_pool, ing.audit.budget, uncertainty, ing.audit.pi_floor)
    audited = draw_poisson_sample(pi, task_rng(params, task, "audit"))
    # the simulated annotator answers from the held-back truth
    audit = pd.DataFrame(
        {
            "id": pool["id"][audited].to_numpy(),
            "pi": pi[audited],
            "member": truth["member"][audited].to_numpy(),
            "label": truth["label"][audited].to_numpy(),
        }
    )
    return {"reference": reference, "pool": pool, "audit": audit, "test": test, "truth": truth}


def read_user_files(params: Params, task: str, root: Path) -> dict[str, pd.DataFrame]:
    base = Path(root) / params.ingest.files_dir / task
    tables = {kind: read_table(base / f"{kind}.parquet", kind) for kind in TABLES}
    if (base / "truth.parquet").exists():
        tables["truth"] = read_table(base / "truth.parquet", "truth")
    else:  # the audit is all the truth a user has
        tables["truth"] = pd.DataFrame(
            {
                "id": tables["audit"]["id"],
                "member": tables["audit"]["member"],
                "label": tables["audit"]["label"],
                "origin": "audit",
            }
        )
    return tables


def check_user_files(params: Params, root: Path) -> dict[str, dict]:
    """source: files, every task checked up front, as ingest would (`crucible data check`, and
    `crucible run` before its flow starts): the folder, the four files, each table's contract and the
    cross-table rules. Returns each task's row counts; the first problem raises, naming the file."""
    base = Path(root) / params.ingest.files_dir
    found = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    counts = {}
    for task in params.pipeline.tasks:
        folder = base / task
        if not folder.is_dir():
            have = f"{base} has: {', '.join(found)}" if found else f"{base} has no task folders"
            raise FileNotFoundError(
                f"{folder}: no such folder, but pipeline.tasks names {task!r} under "
                f"ingest.source: files ({have}); each task needs "
                f"{', '.join(t + '.parquet' for t in TABLES)} there"
            )
        tables = read_user_files(params, task, root)
        check_tables(tables, folder, shared_ids_ok=allow_shared_ids(params))
        counts[task] = {kind: len(tables[kind]) for kind in TABLES}
        counts[task]["short_texts"] = short_texts(tables, params.ingest.min_chars)
    return counts


def short_texts(tables: dict[str, pd.DataFrame], min_chars: int) -> int:
    """Texts under `min_chars` characters in the reference, pool and test (the demo drops such
    corpus items; a user's files keep them, and ingest says how many there are)."""
    return int(sum((tables[k]["text"].str.len() < min_chars).sum() for k in ("reference", "pool", "test")))


def allow_shared_ids(params: Params) -> bool:
    """ingest.allow_shared_ids."""
    return params.ingest.allow_shared_ids


def check_tables(tables: dict[str, pd.DataFrame], base: Path, *, shared_ids_ok: bool = False) -> None:
    """Every contract, and the cross-table ones, on what is about to be written (or was read).

    The order matters for the message: each table on its own first, then the reference's classes
    (before the audit's and test's labels are compared with them, so a one-class reference is
    reported as such, against reference.parquet), then leakage between reference, pool and test.
    """
    sources = {kind: str(base / f"{kind}.parquet") for kind in tables}
    for kind, df in tables.items():
        validate_table(df, kind, source=sources[kind])
    validate_reference_classes(tables["reference"], source=sources["reference"])
    validate_disjoint(tables, sources, allow_shared_ids=shared_ids_ok)
    validate_audit_against_pool(tables["audit"], tables["pool"], source=sources["audit"])
    validate_labels_against_reference(tables["audit"], tables["reference"], source=sources["audit"])
    validate_labels_against_reference(tables["test"], tables["reference"], source=sources["test"])


def summarise(tables: dict[str, pd.DataFrame], params: Params) -> dict:
    pool, audit, truth = tables["pool"], tables["audit"], tables["truth"]
    metrics = {
        "n_reference": len(tables["reference"]),
        "n_pool": len(pool),
        "n_test": len(tables["test"]),
        "n_audit": len(audit),
        "audit_members": int(audit["member"].sum()),
        "n_classes": int(tables["reference"]["label"].nunique()),
    }
    if params.ingest.source == "demo":
        metrics["eps_true"] = float(1.0 - truth["member"].mean())
        metrics["eps_param"] = params.ingest.eps
        metrics["audit_budget"] = params.ingest.audit.budget
    return metrics


def run(params: Params, task: str, root: Path, log) -> dict:
    base = task_dir(root, task)
    if params.ingest.source == "demo":
        tables = build_demo(params, task)
        check_tables(tables, base, shared_ids_ok=allow_shared_ids(params))
    else:
        tables = read_user_files(params, task, root)
        check_tables(tables, Path(root) / params.ingest.files_dir / task, shared_ids_ok=allow_shared_ids(params))
    metrics = summarise(tables, params)
    if params.ingest.source == "files":
        metrics["short_texts"] = short_texts(tables, params.ingest.min_chars)
        if metrics["short_texts"]:
            say(
                f"warning: ingest@{task}: {metrics['short_texts']} texts in {params.ingest.files_dir}/{task} are "
                f"shorter than ingest.min_chars = {params.ingest.min_chars} characters (kept: your files are used "
                f"as they are)"
            )
    with AtomicOutputs() as out:
        for kind, df in tables.items():
            out.parquet(df, base / f"{kind}.parquet")
        out.json(metrics, Path(root) / "metrics" / task / "ingest.json")
    return metrics
