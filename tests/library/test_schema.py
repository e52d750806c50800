"""Input validation: every rule names the file, the column, the row and the value."""

import numpy as np
import pandas as pd
import pytest

from crucible.schema import (
    DataValidationError,
    validate_audit_against_pool,
    validate_disjoint,
    validate_reference_classes,
    validate_table,
)

SRC = "data/t/audit.parquet"


def audit(**over):
    df = pd.DataFrame({"id": ["a", "b", "c"], "pi": [0.5, 1.0, 0.2], "member": [1, 0, 1], "label": ["x", None, "y"]})
    for k, v in over.items():
        df[k] = v
    return df


def expect(df, kind, *fragments):
    with pytest.raises(DataValidationError) as err:
        validate_table(df, kind, SRC)
    for frag in fragments:
        assert frag in str(err.value), str(err.value)
    return err.value


def test_valid_audit_passes():
    validate_table(audit(), "audit", SRC)


def test_missing_column():
    e = expect(audit().drop(columns="pi"), "audit", SRC, "column 'pi'", "the file has columns")
    assert e.column == "pi"


def test_wrong_dtype():
    expect(audit(pi=["0.5", "1", "0.2"]), "audit", "column 'pi'", "numeric column")
    ref = pd.DataFrame({"id": ["a", "b"], "text": ["hello", 3], "label": ["x", "y"]})
    expect(ref, "reference", "column 'text', row 1: got 3", "dtype string")


def test_nan_value():
    e = expect(audit(pi=[0.5, np.nan, 0.2]), "audit", "column 'pi', row 1", "not NaN/inf")
    assert e.row == 1


def test_nan_text():
    pool = pd.DataFrame({"id": ["a", "b"], "text": ["fine", None]})
    expect(pool, "pool", "column 'text', row 1", "non-empty string")


def test_empty_text():
    pool = pd.DataFrame({"id": ["a", "b"], "text": ["fine", "   "]})
    expect(pool, "pool", "column 'text', row 1: got '   '")


def test_duplicate_id():
    expect(audit(id=["a", "b", "a"]), "audit", "column 'id', row 2: got 'a'", "unique ids")


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_pi_outside_unit_interval(bad):
    expect(audit(pi=[0.5, bad, 0.2]), "audit", f"column 'pi', row 1: got {bad}", "(0, 1]")


def test_member_not_binary():
    expect(audit(member=[1, 2, 0]), "audit", "column 'member', row 1: got 2", "0 or 1")


def test_member_without_label():
    expect(audit(label=["x", None, None]), "audit", "column 'label', row 2", "member = 1")


def test_score_outside_unit_interval():
    pool = pd.DataFrame({"id": ["a", "b"], "text": ["x", "y"], "score": [0.2, 1.3]})
    expect(pool, "pool", "column 'score', row 1: got 1.3", "[0, 1]")


def test_audit_id_absent_from_pool():
    pool = pd.DataFrame({"id": ["a", "b"], "text": ["x", "y"]})
    with pytest.raises(
        DataValidationError, match="column 'id', row 2: got 'c'; expected an id that is present in the pool"
    ):
        validate_audit_against_pool(audit(), pool, SRC)


def test_empty_table():
    expect(pd.DataFrame({"id": [], "text": []}), "pool", "non-empty pool table")


# ---- cross-table rules


def tables(**over):
    out = {
        "reference": pd.DataFrame({"id": ["r1", "r2"], "text": ["good", "bad"], "label": ["x", "y"]}),
        "pool": pd.DataFrame({"id": ["p1", "p2", "p3"], "text": ["fine", "poor", "meh"]}),
        "test": pd.DataFrame({"id": ["t1", "t2"], "text": ["nice", "awful"], "label": ["x", "y"]}),
    }
    out.update(over)
    return out


SOURCES = {k: f"data/t/{k}.parquet" for k in ("reference", "pool", "test")}


def test_disjoint_tables_pass():
    validate_disjoint(tables(), SOURCES)
    validate_disjoint({"reference": tables()["reference"], "pool": tables()["pool"]}, SOURCES)  # a reader's pair


def test_single_class_reference_names_the_class_and_count():
    ref = pd.DataFrame({"id": ["a", "b", "c"], "text": ["u", "v", "w"], "label": ["x", "x", "x"]})
    with pytest.raises(DataValidationError) as err:
        validate_reference_classes(ref, "data/t/reference.parquet")
    assert str(err.value) == (
        "data/t/reference.parquet, column 'label': all 3 rows have the single class 'x'; "
        "expected labeled rows of at least two classes (the teacher is a classifier, fitted "
        "and calibrated on the reference); add rows of another class"
    )
    assert (err.value.column, err.value.value) == ("label", "x")
    validate_reference_classes(tables()["reference"], "data/t/reference.parquet")


@pytest.mark.parametrize("first,second,row", [("reference", "test", 1), ("pool", "test", 1), ("reference", "pool", 1)])
def test_shared_id_names_both_files_and_rows(first, second, row):
    t = tables()
    shared = t[first]["id"].iat[0]
    t[second].loc[row, "id"] = shared
    with pytest.raises(DataValidationError) as err:
        validate_disjoint(t, SOURCES)
    msg = str(err.value)
    assert msg.startswith(
        f"data/t/{second}.parquet, column 'id': 1 id(s) also in data/t/{first}.parquet: "
        f"'{shared}' ({second} row {row}, {first} row 0); expected ids disjoint from the {first}'s"
    )
    assert (err.value.source, err.value.column, err.value.row, err.value.value) == (SOURCES[second], "id", row, shared)


def test_allow_shared_ids_covers_test_only():
    t = tables(test=pd.DataFrame({"id": ["r1", "p2"], "text": ["nice", "awful"], "label": ["x", "y"]}))
    validate_disjoint(t, SOURCES, allow_shared_ids=True)
    with pytest.raises(DataValidationError, match="expected ids disjoint from the reference's"):
        validate_disjoint(t, SOURCES)
    t = tables(pool=pd.DataFrame({"id": ["p1", "r2"], "text": ["fine", "poor"]}))
    with pytest.raises(DataValidationError, match="does not cover reference and pool"):
        validate_disjoint(t, SOURCES, allow_shared_ids=True)


def test_many_shared_ids_are_counted_and_the_first_three_listed():
    pool = pd.DataFrame({"id": [f"p{i}" for i in range(6)], "text": [f"w{i}" for i in range(6)]})
    test = pd.DataFrame(
        {"id": ["p5", "p4", "t", "p3", "p2", "p1"], "text": [f"v{i}" for i in range(6)], "label": ["x"] * 6}
    )
    with pytest.raises(
        DataValidationError,
        match=r"5 id\(s\) also in data/t/pool.parquet: 'p5' \(test row 0, "
        r"pool row 5\), 'p4' \(test row 1, pool row 4\), 'p3' \(test row 3, "
        r"pool row 3\) and 2 more; ",
    ):
        validate_disjoint(tables(pool=pool, test=test), SOURCES)


@pytest.mark.parametrize("first", ["reference", "pool"])
def test_test_text_copied_elsewhere_is_refused_even_with_shared_ids_allowed(first):
    long = "an exact copy of a test item, long enough to be shortened in the message " * 2
    t = tables()
    t["test"].loc[1, "text"] = long
    t[first].loc[1, "text"] = long
    with pytest.raises(DataValidationError) as err:
        validate_disjoint(t, SOURCES, allow_shared_ids=True)
    tid, fid = t["test"]["id"].iat[1], t[first]["id"].iat[1]
    assert str(err.value).startswith(
        f"data/t/test.parquet, column 'text': 1 text(s) also in data/t/{first}.parquet, exact copies: "
        f"'{long[:57]}...' (test row 1, id '{tid}'; {first} row 1, id '{fid}'); expected test texts absent from "
        f"the {first}: "
    )
    assert (err.value.column, err.value.row) == ("text", 1)


def test_reference_and_pool_may_share_a_text():
    # not train/test leakage (the reference is training data): only ids must differ there
    t = tables()
    t["pool"].loc[0, "text"] = t["reference"]["text"].iat[0]
    validate_disjoint(t, SOURCES)


def test_a_later_stage_names_its_own_pair():
    labeled = pd.DataFrame({"id": ["r1", "t2"], "text": ["good", "awful"], "label": ["x", "y"]})
    sources = {"labeled": "data/t/labeled.parquet", "test": "data/t/test.parquet"}
    with pytest.raises(
        DataValidationError,
        match=r"data/t/test.parquet, column 'id': 1 id\(s\) also in "
        r"data/t/labeled.parquet: 't2' \(test row 1, labeled row 1\)",
    ):
        validate_disjoint({"labeled": labeled, "test": tables()["test"]}, sources, pairs=(("labeled", "test"),))
    with pytest.raises(DataValidationError, match=r"column 'text': 1 text\(s\) also in data/t/labeled.parquet"):
        validate_disjoint(
            {"labeled": labeled, "test": tables()["test"]}, sources, pairs=(("labeled", "test"),), allow_shared_ids=True
        )
