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
    with pytest.raises(
        ValueError, match=r"missing columns \['text'\]; expected \['id', 'text'\] \(rerun pseudolabel\)"
    ):
        read_stage_output(path, "labeled", ["id", "text"], "pseudolabel")
    pd.DataFrame({"id": ["a"], "text": ["t"]}).to_parquet(path)
    assert read_stage_output(path, "labeled", ["id", "text"], "pseudolabel")["text"].tolist() == ["t"]


def test_every_png_has_the_same_fixed_metadata():
    """figure_png, the one PNG writer: no Software key (the matplotlib version), no date, 110 dpi;
    the stage figures and the report's figures all go through it."""
    import struct

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.runtime.io import figure_png

    def chunks(data):
        i, out = 8, {}
        while i < len(data):
            (n,) = struct.unpack(">I", data[i : i + 4])
            out.setdefault(data[i + 4 : i + 8], []).append(data[i + 8 : i + 8 + n])
            i += 12 + n
        return out

    def draw():
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.plot([0, 1], [1, 0])
        return figure_png(fig)

    data = draw()
    found = chunks(data)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and b"IHDR" in found
    assert b"tIME" not in found and not any(b"Software" in t for t in found.get(b"tEXt", []))
    assert struct.unpack(">IIB", found[b"pHYs"][0]) == (4331, 4331, 1)  # 110 dots per inch, in dots per metre
    assert struct.unpack(">II", found[b"IHDR"][0][:8]) == (220, 110)
    assert draw() == data
    assert not plt.get_fignums()  # closed
