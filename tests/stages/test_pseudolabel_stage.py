"""The pseudolabel stage on the tiny profile: outputs, sources, the dev split, each teacher,
determinism, bad input."""

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from crucible.schema import DataValidationError
from tasks.runtime.io import md5_file
from tasks.stages import execute

# the stage's outputs, relative to the workspace: the table under data/, the metrics and the plot data
# under metrics/, the figure under reports/
OUTPUTS = (
    "data/bbc/labeled.parquet",
    "metrics/bbc/pseudolabel.json",
    "reports/bbc/pseudolabel_confusion.png",
    "metrics/bbc/pseudolabel_confusion.csv",
)


@pytest.fixture(scope="module")
def labeled_project(tmp_path_factory, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path_factory.mktemp("pseudolabel"), "tiny")
    set_pseudolabel(root, teacher="probe")  # seconds a run; the other teachers: their own test
    for stage in ("ingest", "embed", "curate", "pseudolabel"):
        execute(stage, "bbc", root)
    return root


def set_pseudolabel(root, **kw):
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["pseudolabel"].update(kw)
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def test_labeled_table_sources_labels_and_weights(labeled_project):
    base = labeled_project / "data" / "bbc"
    labeled = pd.read_parquet(base / "labeled.parquet")
    assert list(labeled.columns) == ["id", "text", "label", "source", "confidence", "weight", "split"]
    assert labeled["id"].is_unique
    assert set(labeled["source"]) == {"reference", "audit", "pseudo"}
    reference = pd.read_parquet(base / "reference.parquet")
    audit = pd.read_parquet(base / "audit.parquet").set_index("id")
    curated = pd.read_parquet(base / "curated.parquet").set_index("id")
    assert set(labeled["label"]) <= set(reference["label"])
    ref_rows = labeled[labeled["source"] == "reference"]
    assert ref_rows["id"].tolist() == reference["id"].tolist() and (ref_rows["weight"] == 1).all()
    # every audited member is there with its true label; no audited non-member is
    aud_rows = labeled[labeled["source"] == "audit"].set_index("id")
    members = audit[audit["member"] == 1]
    assert sorted(aud_rows.index) == sorted(members.index)
    assert (aud_rows["label"] == members.loc[aud_rows.index, "label"]).all()
    assert not labeled["id"].isin(audit.index[audit["member"] == 0]).any()
    np.testing.assert_allclose(aud_rows["weight"], curated.loc[aud_rows.index, "m"].clip(0, 5.0))
    # pseudo-labels: unaudited, the most confident (their mean confidence reaches the target accuracy),
    # weight = m x confidence (m = s in [0, 1] off the audit)
    metrics = json.loads((labeled_project / "metrics" / "bbc" / "pseudolabel.json").read_text())
    pseudo = labeled[labeled["source"] == "pseudo"].set_index("id")
    assert not pseudo.index.isin(audit.index).any()
    assert (pseudo["confidence"] >= metrics["threshold_used"]).all() and (pseudo["weight"] > 0).all()
    assert metrics["expected_selected_accuracy"] >= 0.9
    np.testing.assert_allclose(pseudo["weight"], curated.loc[pseudo.index, "m"] * pseudo["confidence"])
    assert np.isfinite(labeled["weight"]).all() and (labeled["weight"] >= 0).all()


def test_metrics_intervals_truth_and_plots(labeled_project):
    base = labeled_project / "data" / "bbc"
    metrics = json.loads((labeled_project / "metrics" / "bbc" / "pseudolabel.json").read_text())
    classes = sorted(pd.read_parquet(base / "reference.parquet")["label"].unique())
    names = ["accuracy", "selected_accuracy", *(f"prior_{c}" for c in classes)]
    for name in names:
        assert metrics[f"{name}_ci_low"] <= metrics[name] <= metrics[f"{name}_ci_high"], name
        assert 0 <= metrics[f"{name}_true"] <= 1, name
    assert sum(metrics[f"prior_{c}"] for c in classes) == pytest.approx(1.0)
    assert sum(metrics[f"prior_{c}_true"] for c in classes) == pytest.approx(1.0)
    assert metrics["temperature"] > 0 and metrics["dev_nll"] <= metrics["dev_nll_uncalibrated"]
    assert metrics["teacher_n_fit"] + metrics["n_dev"] == 40  # the tiny profile's reference rows
    assert metrics["selection_gain"] == pytest.approx(metrics["selected_accuracy"] - metrics["accuracy"])
    confusion = pd.read_csv(labeled_project / "metrics" / "bbc" / "pseudolabel_confusion.csv")
    assert list(confusion.columns) == ["actual", "predicted"]
    assert len(confusion) == metrics["n_audit_members"]
    assert (labeled_project / "reports" / "bbc" / "pseudolabel_confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(base.glob("pseudolabel*")), "no metrics or plot files left under data/<task>/"


def test_the_dev_rows_are_a_stratified_quarter_of_the_reference_that_nothing_trains_on(labeled_project):
    labeled = pd.read_parquet(labeled_project / "data" / "bbc" / "labeled.parquet")
    ref = labeled[labeled["source"] == "reference"]
    dev = ref[ref["split"] == "dev"]
    assert (labeled.loc[labeled["source"] != "reference", "split"] == "train").all()
    counts = ref["label"].value_counts()
    for label, n in dev["label"].value_counts().items():
        assert n == min(max(round(0.25 * counts[label]), 1), counts[label] - 1), label
    metrics = json.loads((labeled_project / "metrics" / "bbc" / "pseudolabel.json").read_text())
    assert metrics["n_dev"] == len(dev)


@pytest.mark.parametrize("teacher", ["finetune", "model"])
def test_every_teacher_labels_the_pool_calibrated_on_the_dev_rows(labeled_project, teacher, tmp_path):
    """The base model fine-tuned on the reference's training rows (self-training), and a probe on
    another (larger) model's features: here a tiny random BERT saved in the test, standing in for
    all-mpnet-base-v2. (The probe teacher is the module's fixture.)"""
    from support.tiny_models import save_tiny

    saved = {f: (labeled_project / f).read_bytes() for f in OUTPUTS}
    folder = save_tiny("bert", tmp_path / "teacher")
    set_pseudolabel(labeled_project, teacher=teacher, teacher_model=str(folder))
    try:
        execute("pseudolabel", "bbc", labeled_project)
        metrics = json.loads((labeled_project / "metrics" / "bbc" / "pseudolabel.json").read_text())
        labeled = pd.read_parquet(labeled_project / "data" / "bbc" / "labeled.parquet")
        assert metrics["temperature"] > 0 and 0 <= metrics["dev_accuracy"] <= 1
        assert metrics["teacher_n_fit"] + metrics["n_dev"] == 40
        if teacher == "model":
            assert metrics["teacher_dim"] == 32  # the tiny model's width, not the base model's
        else:
            assert metrics["teacher_steps"] == 20  # 5 passes over 30 training rows in batches of 8
        assert (labeled["split"] == "dev").sum() == metrics["n_dev"]
    finally:
        set_pseudolabel(labeled_project, teacher="probe", teacher_model="all-mpnet-base-v2")
        for f, data in saved.items():
            (labeled_project / f).write_bytes(data)


def test_pseudolabel_is_deterministic(labeled_project):
    before = {f: md5_file(labeled_project / f) for f in OUTPUTS}
    execute("pseudolabel", "bbc", labeled_project)
    assert {f: md5_file(labeled_project / f) for f in OUTPUTS} == before


def test_quota_caps_pseudo_labels_per_class(labeled_project):
    base = labeled_project / "data" / "bbc"
    saved = {f: (labeled_project / f).read_bytes() for f in OUTPUTS}
    set_pseudolabel(labeled_project, selection="quota", quota=3)
    try:
        execute("pseudolabel", "bbc", labeled_project)
        pseudo = pd.read_parquet(base / "labeled.parquet").query("source == 'pseudo'")
        assert 0 < len(pseudo) and pseudo["label"].value_counts().max() <= 3
    finally:
        set_pseudolabel(labeled_project, selection="target", quota=1000)
        for f, data in saved.items():
            (labeled_project / f).write_bytes(data)


def test_an_empty_selection_warns_and_keeps_the_reference_and_audit(labeled_project, capsys):
    saved = {f: (labeled_project / f).read_bytes() for f in OUTPUTS}
    set_pseudolabel(labeled_project, selection="threshold", threshold=1.0)
    try:
        execute("pseudolabel", "bbc", labeled_project)
        labeled = pd.read_parquet(labeled_project / "data" / "bbc" / "labeled.parquet")
        metrics = json.loads((labeled_project / "metrics" / "bbc" / "pseudolabel.json").read_text())
        assert set(labeled["source"]) == {"reference", "audit"} and metrics["n_pseudo"] == 0
        assert "selected_accuracy" not in metrics and "accuracy" in metrics
        assert "pseudolabel@bbc: no pseudo-label kept" in capsys.readouterr().err
    finally:
        set_pseudolabel(labeled_project, selection="target", threshold=0.5)
        for f, data in saved.items():
            (labeled_project / f).write_bytes(data)


def test_audit_label_outside_the_classes_fails(labeled_project):
    base = labeled_project / "data" / "bbc"
    path = base / "audit.parquet"
    saved = path.read_bytes()
    before = md5_file(base / "labeled.parquet")
    audit = pd.read_parquet(path)
    row = int(np.flatnonzero(audit["member"] == 1)[0])
    audit.loc[row, "label"] = "weather"
    audit.to_parquet(path)
    try:
        with pytest.raises(
            ValueError,
            match=r"audit.parquet, column 'label' .* label 'weather', which is not one "
            r"of the task's classes",
        ):
            execute("pseudolabel", "bbc", labeled_project)
    finally:
        path.write_bytes(saved)
    assert md5_file(base / "labeled.parquet") == before


def test_single_class_reference_fails(labeled_project):
    base = labeled_project / "data" / "bbc"
    path = base / "reference.parquet"
    saved = path.read_bytes()
    before = {f: md5_file(labeled_project / f) for f in OUTPUTS}
    ref = pd.read_parquet(path)
    ref["label"] = "business"
    ref.to_parquet(path)  # same ids in the same order: the embeddings still match
    try:
        with pytest.raises(
            DataValidationError,
            match=rf"{base}/reference.parquet, column 'label': all {len(ref)} rows "
            r"have the single class 'business'; expected labeled rows of at "
            r"least two classes",
        ):
            execute("pseudolabel", "bbc", labeled_project)
    finally:
        path.write_bytes(saved)
    assert {f: md5_file(labeled_project / f) for f in OUTPUTS} == before


def test_pool_id_shared_with_the_reference_fails_and_writes_nothing(labeled_project):
    base = labeled_project / "data" / "bbc"
    path = base / "pool.parquet"
    saved = path.read_bytes()
    before = {f: md5_file(labeled_project / f) for f in OUTPUTS}
    pool = pd.read_parquet(path)
    shared = pd.read_parquet(base / "reference.parquet")["id"].iat[3]
    audited = set(pd.read_parquet(base / "audit.parquet")["id"])
    row = next(i for i, v in enumerate(pool["id"]) if v not in audited)
    pool.loc[row, "id"] = shared
    pool.to_parquet(path)
    try:
        with pytest.raises(
            DataValidationError,
            match=rf"{base}/pool.parquet, column 'id': 1 id\(s\) also in "
            rf"{base}/reference.parquet: '{shared}' \(pool row {row}, "
            r"reference row 3\); expected ids disjoint",
        ):
            execute("pseudolabel", "bbc", labeled_project)
    finally:
        path.write_bytes(saved)
    assert {f: md5_file(labeled_project / f) for f in OUTPUTS} == before
