"""Reading validated tables and safetensors files, writing outputs atomically, PNG figures with
fixed metadata, and the md5 of a file.

Every output is written to a temporary file beside its destination and renamed into place only
when complete (os.replace is atomic on POSIX), so a killed stage leaves the previous outputs
intact and no half-written file. `AtomicOutputs` stages several files and publishes them together
only after all of them were written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from crucible.schema import validate_table
from crucible.serialize import read_safetensors  # noqa: F401 (the stages' safetensors reader, below)

_MD5_CACHE: dict[tuple, str] = {}  # (path, device, inode, size, mtime, ctime) -> md5


def md5_file(path: Path | str) -> str:
    """The md5 of a file's bytes (what DVC records for a file). Each file is read once per process:
    the hash is kept under the file's path, inode, size and times, which any rewrite changes, so the
    stage runner's input check, its lineage tags and a later stage in the same process share it."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _MD5_CACHE:
        return _MD5_CACHE[key]
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    after = os.stat(path)
    if (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) == key[2:]:  # not changed while read
        if len(_MD5_CACHE) > 100_000:
            _MD5_CACHE.clear()
        _MD5_CACHE[key] = h.hexdigest()
    return h.hexdigest()


def read_table(path: Path | str, kind: str) -> pd.DataFrame:
    """A parquet table validated against its contract (crucible.schema). Raises DataValidationError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: {kind} table not found")
    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    return validate_table(df, kind, source=str(path))


def read_stage_output(path: Path | str, what: str, columns, stage: str) -> pd.DataFrame:
    """A parquet table written by an earlier stage: it must exist, be readable and hold `columns`;
    each error names the file and the stage that makes it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: {what} table not found; run the {stage} stage first (dvc repro)")
    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({exc}); rerun {stage}") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; expected {list(columns)} (rerun {stage})")
    return df


# The one reader of safetensors files for every stage (tasks/stages, tasks/data, tasks/registry):
# read_safetensors(path, what, rebuild, shapes=..., finite=True) -> (tensors, metadata); a missing,
# truncated or corrupt file, a missing, unexpected or wrongly shaped tensor, or NaN / inf is an
# error naming the file, the tensor and the value, and `rebuild` (the command that remakes it).
# Defined in crucible.serialize (imported above) so that the logged pyfunc, which carries
# crucible's code only, reads its files the same way.

# Every PNG the pipeline writes (stage figures, the report's figures): a fixed resolution, and no
# Software key, so that the bytes depend on the figure alone, not on the matplotlib version
# (matplotlib's PNGs carry no date).
PNG_DPI = 110
PNG_METADATA = {"Software": None}


def figure_png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (for AtomicOutputs.bytes) with the fixed metadata; closes
    the figure."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, metadata=PNG_METADATA)
    plt.close(fig)
    return buf.getvalue()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once at import: os.umask is process-wide and racy between threads


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputWriteError(OSError):
    """An output that cannot be written (a folder that is not writable, or is a file; a full disk):
    the message names the output and the reason, as the stages' other errors do."""

    def __init__(self, dest: Path, exc: OSError):
        super().__init__(exc.errno, exc.strerror or str(exc), str(dest))
        self.reason = exc

    def __str__(self) -> str:
        where = getattr(self.reason, "filename", None)
        at = f" ({where})" if where and str(where) != self.filename else ""
        return (
            f"{self.filename}: cannot write it: {self.strerror}{at}; check that its folder is a writable "
            f"folder with free space"
        )


def rebuild_hint(stage: str, task: str | None = None) -> str:
    """How a reader's error tells the user to remake a stage's output (one wording everywhere)."""
    if task is None:
        return f"rebuild it with `crucible stage {stage}` (or `dvc repro {stage}`)"
    return f"rebuild it with `crucible stage {stage} --task {task}` (or `dvc repro {stage}@{task}`)"


def json_safe(obj):
    """`obj` as strict JSON values, recursively: NaN and infinities -> None (e.g. the backward transfer
    of a single task), numpy scalars -> Python numbers, mapping keys -> str, tuples -> lists."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(float(obj)) else None
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    return obj


class AtomicOutputs:
    """Collect a stage's outputs in temporary files; publish them all at once on success.

    with AtomicOutputs() as out:
        out.parquet(df, "data/bbc/pool.parquet")
        out.json({"eps": 0.3}, "data/bbc/ingest.json")
    # both renamed into place here; on an exception (or a kill) nothing is replaced
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []

    def file(self, dest: Path | str, write: Callable[[Path], None]) -> Path:
        dest = Path(dest)
        from tasks.runtime.scratch import owner_tag, sweep_files

        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            sweep_files(dest.parent)  # a killed earlier run's temporary files; never a live run's
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.{owner_tag()}.", suffix=".tmp", dir=dest.parent)
        except OSError as exc:
            raise OutputWriteError(dest, exc) from None
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs get the usual mode
        os.close(fd)
        tmp = Path(tmp)
        try:
            write(tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise OutputWriteError(dest, exc) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._staged.append((tmp, dest))
        return dest

    def parquet(self, df: pd.DataFrame, dest: Path | str) -> Path:
        return self.file(dest, lambda p: df.to_parquet(p, index=False, compression="zstd"))

    def json(self, obj, dest: Path | str) -> Path:
        """Strict JSON (json_safe): what DVC and MLflow read."""
        text = json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"
        return self.file(dest, lambda p: p.write_text(text))

    def bytes(self, data: bytes, dest: Path | str) -> Path:
        return self.file(dest, lambda p: p.write_bytes(data))

    def publish(self) -> list[Path]:
        published = []
        for tmp, dest in self._staged:
            try:
                os.replace(tmp, dest)
            except OSError as exc:  # e.g. a folder where the file goes: the rest stays staged, then discarded
                raise OutputWriteError(dest, exc) from None
            published.append(dest)
        for parent in {dest.parent for _, dest in self._staged}:
            _fsync_dir(parent)
        self._staged.clear()
        return published

    def discard(self) -> None:
        for tmp, _ in self._staged:
            tmp.unlink(missing_ok=True)
        self._staged.clear()

    def __enter__(self) -> "AtomicOutputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.publish()
        else:
            self.discard()
