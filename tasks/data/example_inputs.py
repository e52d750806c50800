"""Two example tasks in the `source: files` format, to try the "Your own data" walkthrough without
data of your own (`crucible data example`): what a user's inputs/<task>/ holds, made from the
packaged corpora with labels and pools of their own.

- `sport`: BBC News articles labeled `sport` or `other` (a binary task the demo does not have);
- `reviews`: film review snippets labeled `fresh` or `rotten`.

Each pool holds held-out items of the task's own corpus and, at rate `eps`, items of the other
packaged corpora (tweets, debate statements): the contamination curate has to find. The audit is a
uniform sample of the pool (inclusion probability `audit / pool`) whose membership and labels are
known, as an annotator would give them. The same seed gives byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from tasks.data.corpora import load_corpus

TASKS = {"sport": "bbc_news", "reviews": "rotten_tomatoes"}
CONTAMINANTS = ("tweet_sentiment", "debates_party")


def _labels(task: str, labels: pd.Series) -> pd.Series:
    return labels.where(labels == "sports", "other").replace("sports", "sport") if task == "sport" else labels


def example_tables(
    task: str,
    seed: int = 0,
    n_reference: int = 120,
    n_pool: int = 300,
    n_test: int = 120,
    n_audit: int = 40,
    eps: float = 0.3,
) -> dict[str, pd.DataFrame]:
    """The four tables of one example task (reference, pool, audit, test)."""
    rng = np.random.default_rng([seed, sorted(TASKS).index(task)])
    own = load_corpus(TASKS[task])
    own = own.assign(label=_labels(task, own["label"])).iloc[rng.permutation(len(own))].reset_index(drop=True)
    n_members = int(round(n_pool * (1 - eps)))
    reference = own.iloc[:n_reference]
    test = own.iloc[n_reference : n_reference + n_test]
    members = own.iloc[n_reference + n_test : n_reference + n_test + n_members]
    others = pd.concat([load_corpus(c)[["text"]] for c in CONTAMINANTS], ignore_index=True)
    outsiders = others.iloc[rng.choice(len(others), n_pool - n_members, replace=False)]
    pool = pd.concat([members.assign(member=1), outsiders.assign(member=0, label=None)], ignore_index=True)
    pool = pool.iloc[rng.permutation(len(pool))].reset_index(drop=True)
    pool["id"] = [f"{task}-p{i:04d}" for i in range(len(pool))]
    audited = np.sort(rng.choice(len(pool), n_audit, replace=False))
    audit = pd.DataFrame(
        {
            "id": pool["id"].iloc[audited].to_numpy(),
            "pi": n_audit / n_pool,
            "member": pool["member"].iloc[audited].to_numpy().astype(np.int64),
            "label": pool["label"].iloc[audited].to_numpy(),
        }
    )
    return {
        "reference": pd.DataFrame(
            {
                "id": [f"{task}-r{i:04d}" for i in range(len(reference))],
                "text": reference["text"].to_numpy(),
                "label": reference["label"].to_numpy(),
            }
        ),
        "pool": pool[["id", "text"]],
        "audit": audit,
        "test": pd.DataFrame(
            {
                "id": [f"{task}-t{i:04d}" for i in range(len(test))],
                "text": test["text"].to_numpy(),
                "label": test["label"].to_numpy(),
            }
        ),
    }


def write_example_inputs(folder: Path | str, seed: int = 0) -> list[Path]:
    """inputs/<task>/{reference,pool,audit,test}.parquet for both example tasks; the files written."""
    written = []
    for task in TASKS:
        base = Path(folder) / task
        base.mkdir(parents=True, exist_ok=True)
        for kind, df in example_tables(task, seed).items():
            df.to_parquet(base / f"{kind}.parquet", index=False)
            written.append(base / f"{kind}.parquet")
    return written
