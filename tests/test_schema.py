"""Input validation: every rule names the file, the column, the row and the value."""

import numpy as np
import pandas as pd
import pytest

from crucible.schema import DataValidationError, validate_audit_against_pool, validate_table

SRC = "data/t/audit.parquet"


def audit(**over):
    df = pd.DataFrame({"id": ["a", "b", "c"], "pi": [0.5, 1.0, 0.2], "member": [1, 0, 1],
                       "label": ["x", None, "y"]})
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
    with pytest.raises(DataValidationError, match="column 'id', row 2: got 'c'; expected an id that is present in the pool"):
        validate_audit_against_pool(audit(), pool, SRC)


def test_empty_table():
    expect(pd.DataFrame({"id": [], "text": []}), "pool", "non-empty pool table")
