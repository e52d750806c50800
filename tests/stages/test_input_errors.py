"""Cross-table input errors at ingest: a one-class reference, and ids or texts shared between
reference, pool and test (train/test leakage). Each error names the file, the column and the
values, says what is valid, and the stage writes nothing (the earlier outputs keep their md5)."""

import numpy as np
import pandas as pd
import pytest
from test_ingest import set_params

from crucible.schema import DataValidationError
from tasks.runtime.io import md5_file
from tasks.runtime.params import load_params
from tasks.stages import execute

TASK = "bbc"


def _good_tables() -> dict[str, pd.DataFrame]:
    return {
        "reference": pd.DataFrame(
            {"id": ["r1", "r2", "r3"], "text": ["good film", "bad film", "fine film"], "label": ["pos", "neg", "pos"]}
        ),
        "pool": pd.DataFrame({"id": ["p1", "p2", "p3", "p4"], "text": ["great", "awful", "cookie banner", "meh"]}),
        "audit": pd.DataFrame({"id": ["p1", "p3"], "pi": [0.5, 0.5], "member": [1, 0], "label": ["pos", None]}),
        "test": pd.DataFrame({"id": ["t1", "t2"], "text": ["lovely", "dull"], "label": ["pos", "neg"]}),
    }


def _write_inputs(root, tables) -> None:
    base = root / "inputs" / TASK
    base.mkdir(parents=True, exist_ok=True)
    for kind, df in tables.items():
        df.to_parquet(base / f"{kind}.parquet")


def _hashes(root) -> dict:
    base = root / "data" / TASK
    return {p.name: md5_file(p) for p in sorted(base.glob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files_project(tmp_path_factory, project_root):
    """A workspace with source: files whose good inputs were ingested once (the earlier outputs)."""
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path_factory.mktemp("input_errors"), "tiny")
    set_params(root, ingest__source="files", ingest__audit__budget=2)
    _write_inputs(root, _good_tables())
    execute("ingest", TASK, root)
    return root


def _with_allow_shared_ids(root, value: bool):
    """The params with ingest.allow_shared_ids set, through params.yaml once the schema has the field;
    until then on a stand-in section (the stage reads it with getattr)."""
    params = load_params(root / "params.yaml")
    if "allow_shared_ids" in type(params.ingest).model_fields:
        return params.model_copy(update={"ingest": params.ingest.model_copy(update={"allow_shared_ids": value})})

    class Section:
        def __init__(self, inner):
            self._inner = inner
            self.allow_shared_ids = value

        def __getattr__(self, name):
            return getattr(self._inner, name)

    return params.model_copy(update={"ingest": Section(params.ingest)})


def refused(root, change, *fragments, params=None) -> DataValidationError:
    """Apply `change` to the good input tables, expect ingest to refuse with every fragment in its
    message and to leave the earlier outputs byte for byte; restore the good inputs."""
    before = _hashes(root)
    tables = _good_tables()
    change(tables)
    _write_inputs(root, tables)
    try:
        with pytest.raises(DataValidationError) as err:
            execute("ingest", TASK, root, params=params)
    finally:
        _write_inputs(root, _good_tables())
    for frag in fragments:
        frag = frag.replace("{IN}", str(root / "inputs" / TASK))
        assert frag in str(err.value), str(err.value)
    assert _hashes(root) == before, "a refused ingest must leave the earlier outputs intact"
    assert not list((root / "data" / TASK).glob(".*.tmp"))
    return err.value


def test_single_class_reference_is_reported_against_the_reference(files_project):
    def one_class(t):  # the audit's 'neg' used to be reported first, against audit.parquet
        t["reference"]["label"] = "pos"
        t["audit"].loc[0, "label"] = "neg"

    e = refused(
        files_project,
        one_class,
        "{IN}/reference.parquet, column 'label': all 3 rows have the single class 'pos'; "
        "expected labeled rows of at least two classes",
    )
    assert e.source.endswith("reference.parquet") and e.column == "label" and e.value == "pos"
    assert "audit.parquet" not in str(e)


def test_id_shared_by_reference_and_test_is_refused(files_project):
    def leak(t):
        t["test"].loc[1, "id"] = "r2"

    e = refused(
        files_project,
        leak,
        "{IN}/test.parquet, column 'id': 1 id(s) also in {IN}/reference.parquet: 'r2' (test row 1, reference row 1)",
        "train/test leakage",
        "ingest.allow_shared_ids: true",
    )
    assert (e.column, e.row, e.value) == ("id", 1, "r2")


def test_ids_shared_by_pool_and_test_are_counted_and_listed(files_project):
    def leak(t):
        t["test"] = pd.DataFrame(
            {
                "id": ["p4", "p1", "p2", "p3", "t5"],
                "text": ["a1", "b2", "c3", "d4", "e5"],
                "label": ["pos", "neg", "pos", "neg", "pos"],
            }
        )

    refused(
        files_project,
        leak,
        "{IN}/test.parquet, column 'id': 4 id(s) also in {IN}/pool.parquet: "
        "'p4' (test row 0, pool row 3), 'p1' (test row 1, pool row 0), 'p2' (test row 2, pool row 1) and 1 more; "
        "expected ids disjoint from the pool's",
    )


def test_id_shared_by_reference_and_pool_is_refused_even_when_allowed(files_project):
    def leak(t):
        t["pool"].loc[1, "id"] = "r3"

    params = _with_allow_shared_ids(files_project, True)
    refused(
        files_project,
        leak,
        "{IN}/pool.parquet, column 'id': 1 id(s) also in {IN}/reference.parquet: 'r3' (pool row 1, reference row 2)",
        "does not cover reference and pool",
        params=params,
    )


def test_test_text_copied_in_the_pool_is_refused(files_project):
    def leak(t):
        t["pool"].loc[3, "text"] = "dull"

    e = refused(
        files_project,
        leak,
        "{IN}/test.parquet, column 'text': 1 text(s) also in {IN}/pool.parquet, exact "
        "copies: 'dull' (test row 1, id 't2'; pool row 3, id 'p4')",
        "train/test leakage",
    )
    assert (e.column, e.row) == ("text", 1)


def test_test_text_copied_in_the_reference_is_refused_even_when_ids_may_be_shared(files_project):
    def leak(t):
        t["reference"].loc[0, "text"] = "lovely"

    refused(
        files_project,
        leak,
        "{IN}/test.parquet, column 'text': 1 text(s) also in {IN}/reference.parquet",
        "'lovely' (test row 0, id 't1'; reference row 0, id 'r1')",
        params=_with_allow_shared_ids(files_project, True),
    )


def test_allow_shared_ids_accepts_ids_shared_with_test(files_project):
    tables = _good_tables()
    tables["test"]["id"] = ["r1", "p2"]  # ids that number rows, not items: the texts differ
    _write_inputs(files_project, tables)
    try:
        execute("ingest", TASK, files_project, params=_with_allow_shared_ids(files_project, True))
        published = pd.read_parquet(files_project / "data" / TASK / "test.parquet")
        assert published["id"].tolist() == ["r1", "p2"]
    finally:
        _write_inputs(files_project, _good_tables())
        execute("ingest", TASK, files_project)


# ---- the demo: the same checks run on what it builds, before anything is written


def _fake_corpus(name: str, n: int = 600, labels=("a", "b")) -> pd.DataFrame:
    """A corpus in which pairs of texts differ only after their 60th character."""
    rng = np.random.default_rng(len(name))
    head = [f"{name} story {i // 2:04d} " + "lorem ipsum dolor sit amet " * 2 for i in range(n)]
    return pd.DataFrame(
        {
            "text": [h[:60] + f" tail {i} {rng.integers(1000)}" for i, h in enumerate(head)],
            "label": [labels[(i // 2) % len(labels)] for i in range(n)],
        }
    )


@pytest.fixture(scope="module")
def demo_workspace(tmp_path_factory, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path_factory.mktemp("input_errors_demo"), "tiny")
    set_params(root, ingest__max_chars=60, ingest__proxy_score="none", ingest__audit__design="uniform")
    return root


@pytest.fixture
def demo_project(demo_workspace, monkeypatch):
    """The demo on small synthetic corpora (pairs of texts equal in their first 60 characters)."""
    import tasks.stages.ingest

    monkeypatch.setattr(tasks.stages.ingest, "load_corpus", _fake_corpus)
    saved = (demo_workspace / "params.yaml").read_text()
    yield demo_workspace
    (demo_workspace / "params.yaml").write_text(saved)


def test_demo_texts_equal_after_truncation_do_not_leak(demo_project):
    execute("ingest", TASK, demo_project)
    base = demo_project / "data" / TASK
    ref, pool, test = (pd.read_parquet(base / f"{t}.parquet") for t in ("reference", "pool", "test"))
    assert ref["text"].str.len().max() <= 60
    assert not test["text"].isin(pool["text"]).any() and not test["text"].isin(ref["text"]).any()


def test_demo_single_class_reference_names_the_reference(demo_project, monkeypatch):
    import tasks.stages.ingest

    before = _hashes(demo_project)
    monkeypatch.setattr(tasks.stages.ingest, "load_corpus", lambda name: _fake_corpus(name, labels=("a",)))
    with pytest.raises(
        DataValidationError,
        match=rf"task '{TASK}': data/{TASK}/reference.parquet, column 'label': "
        r"the demo drew 40 rows of corpus 'bbc_news', all of the single "
        r"class 'a'; expected at least two classes",
    ):
        execute("ingest", TASK, demo_project)
    assert _hashes(demo_project) == before


def test_demo_leakage_is_refused_before_anything_is_written(demo_project, monkeypatch):
    import tasks.stages.ingest

    execute("ingest", TASK, demo_project)
    before = _hashes(demo_project)
    build = tasks.stages.ingest.build_demo

    def leaky(params, task):
        tables = build(params, task)
        tables["test"].loc[2, "id"] = tables["reference"]["id"].iat[5]
        return tables

    monkeypatch.setattr(tasks.stages.ingest, "build_demo", leaky)
    set_params(demo_project, pipeline__seed=5)  # the next run would change every file
    with pytest.raises(
        DataValidationError,
        match=rf"data/{TASK}/test.parquet, column 'id': 1 id\(s\) also in "
        rf".*data/{TASK}/reference.parquet: '{TASK}-r000005' "
        r"\(test row 2, reference row 5\)",
    ):
        execute("ingest", TASK, demo_project)
    assert _hashes(demo_project) == before
