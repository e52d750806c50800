"""Where the stages' outputs live, relative to the workspace: one name per path, imported by the
stage that writes it and by every stage (or reader) that reads it."""

from __future__ import annotations

from pathlib import Path

METRICS = Path("metrics")  # small files git can commit: `dvc metrics diff` / `dvc plots diff` against HEAD
REPORTS = Path("reports")
BASE_MANIFEST = Path("models") / "base" / "manifest.json"  # the model stage's hash of the base model
MERGE = Path("models") / "merge"
QUANTIZE = Path("models") / "quantize"
MOE_BUILD = Path("models") / "moe" / "build"
MOE_QUANTIZE = Path("models") / "moe" / "quantize"
EVALUATE_JSON = METRICS / "evaluate.json"
PREDICTIONS = METRICS / "predictions.parquet"
REGISTERED = METRICS / "registered.json"
MOE_JSON = METRICS / "moe.json"
QUANTIZE_JSON = METRICS / "quantize.json"


def task_data(task: str) -> Path:
    """data/<task>/: the task's tables and the stages' per-task outputs."""
    return Path("data") / task
