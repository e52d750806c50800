"""Quiet output (tasks/runtime/quiet.py): what other libraries print that tells a user nothing is gone
from a stage's stderr, which says what the stage did in one line per job; what else those libraries
say, and our own warnings, still show. Each check runs in a fresh process, as `crucible` does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]

# what the libraries printed on every run before quiet.install() (the list)
NOISE = (
    "torchao",
    "Failed to load",
    "register_constant",
    "is an Enum subclass",
    "Add type hints",
    "Validating input example",
    "Downloading artifacts",
    "Loading weights",
    "Creating initial MLflow database tables",
    "Updating database tables",
)


def run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


# The libraries' own calls (torchao's import, with torch's deprecation about it) and, through the
# loggers they use, the other messages they may print: dropped and kept by name.
SCRIPT = """
import logging, warnings
from tasks.runtime import quiet
quiet.install()
import mlflow  # sets up MLflow's loggers, as any stage does
try:
    import torchao  # what transformers does whenever torchao is installed
except ImportError:
    pass
logging.getLogger("mlflow.pyfunc").info("Validating input example against model signature")
logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
logging.getLogger("mlflow.store.db.utils").info("Updating database tables")
logging.getLogger("torchao").warning("KEPT torchao: Skipping import of cpp extensions (incompatible torch version)")
logging.getLogger("torch.utils._pytree").warning("KEPT pytree: a warning of another kind")
logging.getLogger("mlflow.pyfunc").warning("KEPT mlflow: The version of torch differs from the logged one")
logging.getLogger("mlflow.store.db.utils").warning("KEPT mlflow: the database is read-only")
warnings.warn("KEPT ours: a warning of crucible's own", UserWarning)
"""


def test_library_noise_is_dropped_by_name_and_everything_else_shows():
    quiet, loud = run(SCRIPT), run(SCRIPT, {"CRUCIBLE_QUIET": "0"})  # loud: the control, as before
    assert quiet.returncode == 0, quiet.stderr
    assert loud.returncode == 0, loud.stderr
    # the control prints what the quiet run drops (torchao's complaints where its import makes them)
    for message in ("Validating input example", "Creating initial MLflow database tables", "Updating database tables"):
        assert message in loud.stderr, loud.stderr
    for noise in NOISE:
        assert noise not in quiet.stderr.replace("KEPT torchao", ""), quiet.stderr
    for line in quiet.stderr.splitlines():
        if line.strip() and not line.startswith("  "):  # (a warning's source line follows it, indented)
            assert "KEPT" in line, f"unexpected stderr line: {line!r}\n{quiet.stderr}"
    for kept in ("KEPT torchao", "KEPT pytree", "KEPT mlflow: The version", "KEPT mlflow: the database", "KEPT ours"):
        assert kept in quiet.stderr and kept in loud.stderr, quiet.stderr


def test_install_leaves_the_users_switches_alone():
    code = (
        "import os; from tasks.runtime import quiet; quiet.install(); quiet.install(); import logging; "
        "print(os.environ['HF_HUB_DISABLE_PROGRESS_BARS'], os.environ['MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR'], "
        "len(logging.getLogger('torchao').filters))"
    )
    assert run(code).stdout.split() == ["1", "false", "1"]  # defaults set; installing twice adds nothing
    user = run(code, {"HF_HUB_DISABLE_PROGRESS_BARS": "0", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "true"})
    assert user.stdout.split() == ["0", "true", "1"]


@pytest.fixture
def finetune_project(tmp_path_factory):
    """A tiny-profile workspace with one task's labeled and test tables (what pseudolabel and ingest
    write), so that finetune runs alone: it loads the model, trains and logs an MLflow model."""
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(ROOT, tmp_path_factory.mktemp("quiet"), "tiny")
    words = {"fresh": ["wonderful", "moving", "brilliant"], "rotten": ["dull", "tedious", "awful"]}
    rows = [
        {
            "id": f"r{i}",
            "text": f"the film is {words[lab][i % 3]} and {words[lab][(i + 1) % 3]}",
            "label": lab,
            "source": "reference",
            "confidence": 1.0,
            "weight": 1.0,
            "split": "dev" if i % 5 == 0 else "train",
        }
        for i, lab in enumerate(["fresh", "rotten"] * 20)
    ]
    test = [
        {"id": f"t{i}", "text": f"this movie was {words[lab][(i + 2) % 3]} as well", "label": lab}
        for i, lab in enumerate(["fresh", "rotten"] * 10)
    ]
    (root / "data" / "rotten").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(root / "data" / "rotten" / "labeled.parquet", index=False)
    pd.DataFrame(test).to_parquet(root / "data" / "rotten" / "test.parquet", index=False)
    return root


@pytest.mark.long
def test_a_stage_under_crucible_says_one_line_and_nothing_of_the_libraries(finetune_project):
    """`crucible stage finetune` with stderr in a file (as under `dvc repro` to a log, or CI): the
    model load, the training and log_model used to print torchao's and torch's complaints,
    transformers' and MLflow's bars and MLflow's warning and notes; now one line says what ran."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CRUCIBLE_THREADS": "1", "CRUCIBLE_PROGRESS_EVERY": "3600"}
    env.pop("CRUCIBLE_PROGRESS", None)
    env.pop("CRUCIBLE_QUIET", None)
    for args in (["model"], ["finetune", "--task", "rotten"]):
        proc = subprocess.run(
            [sys.executable, "-m", "flows.cli", "stage", *args, "--root", str(finetune_project)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        for noise in NOISE:
            assert noise not in proc.stderr, proc.stderr
        assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"finetune@rotten: \d+/\d+ step in .+ loss=\S+ ex_s=\S+", lines[0]), (
        proc.stderr
    )


BAR_MODULE = "from tqdm.auto import tqdm\n\n\ndef work():\n    return sum(tqdm(range(3), desc='DRAWN BAR'))\n"


def test_without_bar_silences_that_modules_bar_only(tmp_path):
    """transformers' GGUF conversion draws a plain tqdm bar no switch of its own reaches: within
    `quiet.without_bar(module)` that module's bars are off, and the module works as before; another
    module's bar still shows, and CRUCIBLE_QUIET=0 shows it too."""
    (tmp_path / "barmod.py").write_text(BAR_MODULE)
    (tmp_path / "othermod.py").write_text(BAR_MODULE.replace("DRAWN BAR", "OTHER BAR"))
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import barmod, othermod\n"
        "from tasks.runtime import quiet\n"
        "with quiet.without_bar('barmod'):\n"
        "    print(barmod.work(), othermod.work())\n"
        "import functools; print(isinstance(barmod.tqdm, functools.partial))\n"
    )
    quiet_run, loud = run(code), run(code, {"CRUCIBLE_QUIET": "0"})
    assert quiet_run.returncode == 0 and loud.returncode == 0, quiet_run.stderr + loud.stderr
    assert quiet_run.stdout.split() == ["3", "3", "False"]  # the result unchanged; tqdm restored after
    assert "DRAWN BAR" not in quiet_run.stderr and "OTHER BAR" in quiet_run.stderr, quiet_run.stderr
    assert "DRAWN BAR" in loud.stderr, loud.stderr
