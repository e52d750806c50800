"""The data contracts of docs/architecture.md ("Data contracts"), checked on every read.

Four tables per task (reference, pool, audit, test) plus the demo's truth file. A check that fails
raises `DataValidationError` naming the file, the column, the first offending row and its value,
and what would be valid; the calling stage then writes nothing.

    validate_table(df, "audit", source="data/bbc/audit.parquet")
    validate_audit_against_pool(audit, pool, source="data/bbc/audit.parquet")
    validate_reference_classes(reference, source="data/bbc/reference.parquet")
    validate_disjoint({"reference": reference, "pool": pool, "test": test},
                      {"reference": "data/bbc/reference.parquet", ...})

Cross-table rules: the reference holds at least two classes; no id is in two of reference, pool and
test, and no test text is an exact copy of a reference or pool text (train/test leakage).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


class DataValidationError(ValueError):
    """A table breaks its contract. The message names file, column, row, value and what is valid."""

    def __init__(
        self, source: str, column: str | None, row: int | None, value, expected: str, message: str | None = None
    ):
        if hasattr(value, "item"):  # numpy scalar: show it as the plain value the user wrote
            value = value.item()
        self.source, self.column, self.row, self.value, self.expected = source, column, row, value, expected
        if message is not None:  # a cross-table rule words its own message (it names two files)
            super().__init__(message)
            return
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
    "truth": (
        Column("id", "id"),
        Column("member", "flag"),
        Column("label", "label", nullable=True),
        Column("origin", "label"),
    ),
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
        raise DataValidationError(
            source, col.name, row, values.iloc[row], _EXPECTED[col.kind] + f" (dtype string, not {values.dtype})"
        )
    empty = present.map(lambda v: len(v.strip()) == 0).to_numpy(dtype=bool)
    if (k := _first_bad(empty)) is not None:
        row = int(np.flatnonzero(~is_null)[k])
        raise DataValidationError(source, col.name, row, values.iloc[row], _EXPECTED[col.kind])


def _check_numbers(df: pd.DataFrame, col: Column, source: str) -> np.ndarray:
    values = df[col.name]
    if not (pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)) and not (
        col.kind == "flag" and pd.api.types.is_bool_dtype(values)
    ):
        raise DataValidationError(
            source, col.name, None, None, f"a numeric column ({_EXPECTED[col.kind]}), found dtype {values.dtype}"
        )
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
            raise DataValidationError(
                source,
                col.name,
                None,
                None,
                f"a column '{col.name}' ({_EXPECTED[col.kind]}); the file has columns {list(map(str, df.columns))}",
            )
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
            raise DataValidationError(
                source, "label", row, None, "a class label on every row with member = 1 (the annotator's answer)"
            )
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
        raise DataValidationError(
            source, "label", row, labels.iloc[row], f"one of the reference's classes {sorted(classes)}"
        )


def validate_reference_classes(reference: pd.DataFrame, source: str) -> None:
    """The reference must hold labeled items of at least two classes: the teacher is a classifier,
    and the splits that calibrate and evaluate it are stratified by class."""
    counts = reference["label"].value_counts()
    if len(counts) < 2:
        only = counts.index[0] if len(counts) else None
        raise DataValidationError(
            source,
            "label",
            None,
            only,
            "at least two classes",
            message=f"{source}, column 'label': all {len(reference)} rows have the single class {only!r}; expected "
            "labeled rows of at least two classes (the teacher is a classifier, fitted and calibrated on "
            "the reference); add rows of another class",
        )


# (first, second) pairs that must not share items; the second is the file an error is reported against
LEAKAGE_PAIRS = (("reference", "test"), ("pool", "test"), ("reference", "pool"))
_SHOW = 3  # how many shared ids or texts an error lists


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def shared_ids(first: pd.DataFrame, second: pd.DataFrame) -> np.ndarray:
    """Rows of `second` (positions, in order) whose id is also an id of `first`."""
    return np.flatnonzero(second["id"].isin(first["id"]).to_numpy())


def shared_texts(first: pd.DataFrame, second: pd.DataFrame) -> np.ndarray:
    """Rows of `second` (positions, in order) whose text is an exact copy of a text of `first`."""
    return np.flatnonzero(second["text"].isin(first["text"]).to_numpy())


def _listing(first: str, second: str, a: pd.DataFrame, b: pd.DataFrame, column: str, rows: np.ndarray) -> str:
    """The first few shared values, each with its row (and id) in both tables."""
    row_in_a = {v: i for i, v in reversed(list(enumerate(a[column])))}
    parts = []
    for r in rows[:_SHOW]:
        v = b[column].iat[r]
        ra = row_in_a[v]
        if column == "id":
            parts.append(f"{_short(v)!r} ({second} row {r}, {first} row {ra})")
        else:
            parts.append(
                f"{_short(v)!r} ({second} row {r}, id {b['id'].iat[r]!r}; {first} row {ra}, id {a['id'].iat[ra]!r})"
            )
    more = f" and {rows.size - _SHOW} more" if rows.size > _SHOW else ""
    return ", ".join(parts) + more


def validate_disjoint(
    tables: dict[str, pd.DataFrame], sources: dict[str, str], *, allow_shared_ids: bool = False, pairs=LEAKAGE_PAIRS
) -> None:
    """No item in two of reference, pool and test: train/test leakage, or an item counted twice.

    For each pair of `pairs` (default LEAKAGE_PAIRS) present in `tables` (kind -> validated frame;
    `sources` maps each kind to its file): no id in both, and, where the second is "test", no text in
    both (exact match: the demo's near-duplicate contaminants are deliberately near, not exact,
    copies). A later stage passes its own, e.g. pairs=(("labeled", "test"),).
    allow_shared_ids (param ingest.allow_shared_ids) accepts ids shared with test, for files whose
    ids number rows rather than name items; the texts are still compared. Reference and pool ids
    must stay disjoint regardless: pseudolabel joins their rows into one table keyed by id.
    Raises DataValidationError naming both files, the number of shared ids or texts and the first
    few, reported against the second file of the pair at its first shared row.
    """
    for first, second in pairs:
        if first not in tables or second not in tables:
            continue
        a, b = tables[first], tables[second]
        src_a, src_b = sources[first], sources[second]
        with_test = second == "test"
        rows = shared_ids(a, b)
        if rows.size and not (allow_shared_ids and with_test):
            if with_test:
                why = (
                    f"a {first} item that is also a test item is train/test leakage. Give distinct items distinct "
                    "ids and keep test items out of the other files; if the ids only number the rows of each "
                    "file, set ingest.allow_shared_ids: true (the texts are still compared)"
                )
            else:
                why = (
                    "an item in both is trained on twice and pseudo-labeled by a teacher fitted on it. Remove it "
                    "from one file or give distinct items distinct ids (ingest.allow_shared_ids does not cover "
                    "reference and pool: pseudolabel joins their rows into one table keyed by id)"
                )
            raise DataValidationError(
                src_b,
                "id",
                int(rows[0]),
                b["id"].iat[rows[0]],
                f"ids disjoint from {src_a}",
                message=f"{src_b}, column 'id': {rows.size} id(s) also in {src_a}: "
                f"{_listing(first, second, a, b, 'id', rows)}; expected ids disjoint from the {first}'s: {why}",
            )
        if not with_test:
            continue
        rows = shared_texts(a, b)
        if rows.size:
            raise DataValidationError(
                src_b,
                "text",
                int(rows[0]),
                _short(b["text"].iat[rows[0]]),
                f"texts absent from {src_a}",
                message=f"{src_b}, column 'text': {rows.size} text(s) also in {src_a}, exact copies: "
                f"{_listing(first, second, a, b, 'text', rows)}; expected test texts absent from the "
                f"{first}: a test item that is also a {first} item is train/test leakage. Remove the copies "
                "from one of the two files",
            )
