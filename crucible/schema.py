"""The data contracts of ARCHITECTURE.md ("Data contracts"), checked on every read.

Four tables per task (reference, pool, audit, test) plus the demo's truth file. A check that fails
raises `DataValidationError` naming the file, the column, the first offending row and its value,
and what would be valid; the calling stage then writes nothing.

    validate_table(df, "audit", source="data/bbc/audit.parquet")
    validate_audit_against_pool(audit, pool, source="data/bbc/audit.parquet")
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


class DataValidationError(ValueError):
    """A table breaks its contract. The message names file, column, row, value and what is valid."""

    def __init__(self, source: str, column: str | None, row: int | None, value, expected: str):
        if hasattr(value, "item"):  # numpy scalar: show it as the plain value the user wrote
            value = value.item()
        self.source, self.column, self.row, self.value, self.expected = source, column, row, value, expected
        where = source
        if column is not None:
            where += f", column '{column}'"
        if row is not None:
            where += f", row {row}"
        got = "" if value is None and row is None else f": got {value!r}"
        super().__init__(f"{where}{got}; expected {expected}")


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # "id" | "text" | "label" | "prob" | "flag" | "score"
    required: bool = True
    nullable: bool = False  # only audit.label (null where the item is not a member)


TABLES: dict[str, tuple[Column, ...]] = {
    "reference": (Column("id", "id"), Column("text", "text"), Column("label", "label")),
    "pool": (Column("id", "id"), Column("text", "text"), Column("score", "score", required=False)),
    "audit": (
        Column("id", "id"),
        Column("pi", "prob"),
        Column("member", "flag"),
        Column("label", "label", nullable=True),
    ),
    "test": (Column("id", "id"), Column("text", "text"), Column("label", "label")),
    "truth": (Column("id", "id"), Column("member", "flag"), Column("label", "label", nullable=True),
              Column("origin", "label")),
}

_EXPECTED = {
    "id": "a unique, non-empty string id",
    "text": "a non-empty string",
    "label": "a non-empty string class label",
    "prob": "an inclusion probability in (0, 1]",
    "flag": "0 or 1",
    "score": "a proxy score in [0, 1]",
}


def _first_bad(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _check_strings(df: pd.DataFrame, col: Column, source: str) -> None:
    values = df[col.name]
    is_null = values.isna().to_numpy()
    if not col.nullable and (row := _first_bad(is_null)) is not None:
        raise DataValidationError(source, col.name, row, values.iloc[row], _EXPECTED[col.kind])
    present = values[~is_null]
    not_str = ~present.map(lambda v: isinstance(v, str)).to_numpy(dtype=bool)
    if (k := _first_bad(not_str)) is not None:
        row = int(np.flatnonzero(~is_null)[k])
        raise DataValidationError(source, col.name, row, values.iloc[row],
                                  _EXPECTED[col.kind] + f" (dtype string, not {values.dtype})")
    empty = present.map(lambda v: len(v.strip()) == 0).to_numpy(dtype=bool)
    if (k := _first_bad(empty)) is not None:
        row = int(np.flatnonzero(~is_null)[k])
        raise DataValidationError(source, col.name, row, values.iloc[row], _EXPECTED[col.kind])


def _check_numbers(df: pd.DataFrame, col: Column, source: str) -> np.ndarray:
    values = df[col.name]
    if not (pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)) \
            and not (col.kind == "flag" and pd.api.types.is_bool_dtype(values)):
        raise DataValidationError(source, col.name, None, None,
                                  f"a numeric column ({_EXPECTED[col.kind]}), found dtype {values.dtype}")
    x = values.to_numpy(dtype=np.float64, na_value=np.nan)
    if (row := _first_bad(~np.isfinite(x))) is not None:
        raise DataValidationError(source, col.name, row, values.iloc[row], _EXPECTED[col.kind] + ", not NaN/inf")
    if col.kind == "prob":
        bad = (x <= 0) | (x > 1)
    elif col.kind == "flag":
        bad = (x != 0) & (x != 1)
    else:  # score
        bad = (x < 0) | (x > 1)
    if (row := _first_bad(bad)) is not None:
        raise DataValidationError(source, col.name, row, values.iloc[row], _EXPECTED[col.kind])
    return x


def validate_table(df: pd.DataFrame, kind: str, source: str) -> pd.DataFrame:
    """Check `df` against the contract of table `kind`; return it unchanged. Raises DataValidationError."""
    if kind not in TABLES:
        raise ValueError(f"unknown table kind {kind!r}; valid: {sorted(TABLES)}")
    columns = TABLES[kind]
    for col in columns:
        if col.required and col.name not in df.columns:
            raise DataValidationError(source, col.name, None, None,
                                      f"a column '{col.name}' ({_EXPECTED[col.kind]}); "
                                      f"the file has columns {list(map(str, df.columns))}")
    if len(df) == 0:
        raise DataValidationError(source, None, None, None, f"a non-empty {kind} table")
    for col in columns:
        if col.name not in df.columns:
            continue
        if col.kind in ("id", "text", "label"):
            _check_strings(df, col, source)
        else:
            _check_numbers(df, col, source)
    dup = df["id"].duplicated().to_numpy()
    if (row := _first_bad(dup)) is not None:
        raise DataValidationError(source, "id", row, df["id"].iloc[row], "unique ids (this id appears earlier)")
    if kind in ("audit", "truth"):
        member = df["member"].to_numpy(dtype=np.float64)
        missing_label = df["label"].isna().to_numpy() & (member == 1)
        if (row := _first_bad(missing_label)) is not None:
            raise DataValidationError(source, "label", row, None,
                                      "a class label on every row with member = 1 (the annotator's answer)")
    return df


def validate_audit_against_pool(audit: pd.DataFrame, pool: pd.DataFrame, source: str) -> None:
    """Every audited id must be a pool id."""
    absent = ~audit["id"].isin(pool["id"]).to_numpy()
    if (row := _first_bad(absent)) is not None:
        raise DataValidationError(source, "id", row, audit["id"].iloc[row], "an id that is present in the pool")


def validate_labels_against_reference(df: pd.DataFrame, reference: pd.DataFrame, source: str) -> None:
    """Labels (where present) must be among the reference's classes."""
    classes = set(reference["label"].unique())
    labels = df["label"]
    bad = labels.notna().to_numpy() & ~labels.isin(classes).to_numpy()
    if (row := _first_bad(bad)) is not None:
        raise DataValidationError(source, "label", row, labels.iloc[row],
                                  f"one of the reference's classes {sorted(classes)}")
