"""The embed and curate stages on the tiny profile: metrics, the gate, bad input."""

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from crucible.schema import DataValidationError
from tasks.runtime.io import md5_file
from tasks.stages import execute
from tasks.stages.curate import DataQualityGateError

# the stage's outputs, relative to the workspace: the table under data/, the metrics under metrics/,
# the figure under reports/
OUTPUTS = ("data/rotten/curated.parquet", "metrics/rotten/curate.json", "reports/rotten/curate.png")


@pytest.fixture(scope="module")
def curated_project(tmp_path_factory, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path_factory.mktemp("curate"), "tiny")
    for stage in ("ingest", "embed", "curate"):
        execute(stage, "rotten", root)
    return root


def set_curate(root, **kw):
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["curate"].update(kw)
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def test_curate_outputs_and_metrics(curated_project):
    base = curated_project / "data" / "rotten"
    curated = pd.read_parquet(base / "curated.parquet")
    pool = pd.read_parquet(base / "pool.parquet")
    audit = pd.read_parquet(base / "audit.parquet").set_index("id")
    assert curated["id"].tolist() == pool["id"].tolist()
    assert curated["score"].between(0, 1).all()
    # m_j = s_j off the audit; s_j + (M_j - s_j) / pi_j on it
    off = curated["audited"] == 0
    assert np.allclose(curated.loc[off, "m"], curated.loc[off, "score"])
    on = curated[~off].set_index("id")
    expected = on["score"] + (audit.loc[on.index, "member"] - on["score"]) / audit.loc[on.index, "pi"]
    assert np.allclose(on["m"], expected)
    assert (curated["keep"] == (curated["m"] > 0.5)).all()
    metrics = json.loads((curated_project / "metrics" / "rotten" / "curate.json").read_text())
    for key in ("ccmmd_value", "ccmmd_ci_low", "ccmmd_ci_high", "naive", "audit_only", "oracle", "eps_hat", "eps_true"):
        assert np.isfinite(metrics[key]), key
    assert metrics["ccmmd_ci_low"] <= metrics["ccmmd_value"] <= metrics["ccmmd_ci_high"]
    assert metrics["eps_hat"] == pytest.approx(1 - curated["m"].sum() / len(curated))
    assert (curated_project / "reports" / "rotten" / "curate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (base / "curate.json").exists() and not (base / "curate.png").exists()


def test_curate_is_deterministic(curated_project):
    before = {f: md5_file(curated_project / f) for f in OUTPUTS}
    execute("curate", "rotten", curated_project)
    assert {f: md5_file(curated_project / f) for f in before} == before


def test_gate_failure_names_the_figures_and_writes_nothing(curated_project):
    before = {f: md5_file(curated_project / f) for f in OUTPUTS}
    set_curate(curated_project, gate_max_ccmmd=-1.0)
    try:
        with pytest.raises(
            DataQualityGateError, match=r"task 'rotten': data-quality gate failed: CC-MMD\^2 = .* interval"
        ):
            execute("curate", "rotten", curated_project)
    finally:
        set_curate(curated_project, gate_max_ccmmd=None)
    assert {f: md5_file(curated_project / f) for f in OUTPUTS} == before


def test_scorer_column_needs_a_score_column(curated_project):
    set_curate(curated_project, scorer="column")
    try:
        execute("curate", "rotten", curated_project)  # the demo pool carries the lexical score
        pool = curated_project / "data" / "rotten" / "pool.parquet"
        saved = pool.read_bytes()
        pd.read_parquet(pool).drop(columns="score").to_parquet(pool)
        try:
            with pytest.raises(ValueError, match="pool has no 'score' column"):
                execute("curate", "rotten", curated_project)
        finally:
            pool.write_bytes(saved)
    finally:
        set_curate(curated_project, scorer="domain_classifier")


def test_embeddings_for_other_rows_are_refused(curated_project):
    ref = curated_project / "data" / "rotten" / "reference.parquet"
    saved = ref.read_bytes()
    df = pd.read_parquet(ref)
    df.iloc[::-1].to_parquet(ref)
    try:
        with pytest.raises(ValueError, match="embeddings of 'reference' were computed for other rows"):
            execute("curate", "rotten", curated_project)
    finally:
        ref.write_bytes(saved)


@pytest.mark.parametrize("table", ["reference", "pool"])
def test_bad_reference_or_shared_ids_are_refused_before_curating(curated_project, table):
    base = curated_project / "data" / "rotten"
    before = {f: md5_file(curated_project / f) for f in OUTPUTS}
    path = base / f"{table}.parquet"
    saved = path.read_bytes()
    df = pd.read_parquet(path)
    if table == "reference":  # one class
        df["label"] = "fresh"
        expected = rf"{base}/reference.parquet, column 'label': all {len(df)} rows have the single class 'fresh'"
    else:  # an unaudited pool item under a reference id
        audited = set(pd.read_parquet(base / "audit.parquet")["id"])
        row = next(i for i, v in enumerate(df["id"]) if v not in audited)
        df.loc[row, "id"] = pd.read_parquet(base / "reference.parquet")["id"].iat[0]
        expected = rf"{base}/pool.parquet, column 'id': 1 id\(s\) also in {base}/reference.parquet"
    df.to_parquet(path)
    try:
        with pytest.raises(DataValidationError, match=expected):
            execute("curate", "rotten", curated_project)
    finally:
        path.write_bytes(saved)
    assert {f: md5_file(curated_project / f) for f in OUTPUTS} == before
