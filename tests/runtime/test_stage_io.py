"""Reading an earlier stage's table: each failure names the file and the stage that makes it."""

import pandas as pd
import pytest

from tasks.runtime.io import read_stage_output


def test_read_stage_output_errors_and_success(tmp_path):
    path = tmp_path / "labeled.parquet"
    with pytest.raises(FileNotFoundError, match=r"labeled.parquet: labeled table not found; run the pseudolabel stage"):
        read_stage_output(path, "labeled", ["id", "text"], "pseudolabel")
    path.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"labeled.parquet: not a readable parquet file.*rerun pseudolabel"):
        read_stage_output(path, "labeled", ["id", "text"], "pseudolabel")
    pd.DataFrame({"id": ["a"], "label": ["x"]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"missing columns \['text'\]; expected \['id', 'text'\] \(rerun pseudolabel\)"):
        read_stage_output(path, "labeled", ["id", "text"], "pseudolabel")
    pd.DataFrame({"id": ["a"], "text": ["t"]}).to_parquet(path)
    assert read_stage_output(path, "labeled", ["id", "text"], "pseudolabel")["text"].tolist() == ["t"]
