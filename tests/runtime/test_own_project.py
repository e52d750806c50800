"""A user's own project (ingest.source: files): a profile that replaces the task list, the input
files checked before a run starts, demo-only params warned about, and `crucible run` failing with
one `error:` line and its traceback in a log file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tasks.runtime.params import ParamsError, load_params, render_params
from tasks.runtime.params_schema import demo_only_settings

BIN = Path(sys.executable).parent


def crucible(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "crucible"), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def write_profile(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_override_replaces_the_inherited_task_list(project_root, tmp_path):
    merged = write_profile(
        tmp_path / "merged.yaml", "extends: demo\npipeline:\n  tasks:\n    spam: {corpus: bbc_news}\n"
    )
    replaced = write_profile(
        tmp_path / "replaced.yaml", "extends: demo\npipeline:\n  tasks: !override\n    spam: {corpus: bbc_news}\n"
    )
    # without the marker a profile adds to the four demo tasks it inherits; with it, spam is the only one
    assert list(load_params(project_root / "params.yaml", str(merged)).pipeline.tasks) == [
        "bbc",
        "rotten",
        "tweets",
        "trec",
        "spam",
    ]
    assert list(load_params(project_root / "params.yaml", str(replaced)).pipeline.tasks) == ["spam"]
    # the rendered params (what DVC's foreach reads) hold plain mappings: YAML can write them
    rendered = render_params(project_root / "params.yaml", str(replaced))
    assert yaml.safe_load(yaml.safe_dump(rendered))["pipeline"]["tasks"] == {"spam": {"corpus": "bbc_news"}}


def test_override_through_extends_and_on_a_scalar(project_root, tmp_path):
    # files.yaml replaces the demo tasks by the two example tasks; a profile extending it adds to
    # them, or replaces them again
    files = load_params(project_root / "params.yaml", "files")
    assert list(files.pipeline.tasks) == ["sport", "reviews"] and files.ingest.source == "files"
    assert list(files.merge.methods) == ["gs3r", "task_arithmetic"]
    more = write_profile(tmp_path / "more.yaml", "extends: files\npipeline:\n  tasks:\n    spam: {}\n")
    assert list(load_params(project_root / "params.yaml", str(more)).pipeline.tasks) == ["sport", "reviews", "spam"]
    mine = write_profile(tmp_path / "mine.yaml", "extends: files\npipeline:\n  tasks: !override\n    spam: {}\n")
    assert list(load_params(project_root / "params.yaml", str(mine)).pipeline.tasks) == ["spam"]
    empty = write_profile(tmp_path / "empty.yaml", "extends: files\npipeline:\n  tasks: !override {}\n")
    with pytest.raises(ParamsError, match="no tasks: name at least one"):
        load_params(project_root / "params.yaml", str(empty))
    bad = write_profile(tmp_path / "bad.yaml", "finetune:\n  lr: !override 0.1\n")
    with pytest.raises(ParamsError, match="!override marks a mapping"):
        load_params(project_root / "params.yaml", str(bad))


def test_demo_only_params_under_files_are_listed(project_root, tmp_path):
    mine = write_profile(
        tmp_path / "mine.yaml",
        "extends: files\ningest:\n  eps: 0.1\n  min_chars: 5\npipeline:\n  tasks:\n    spam: {n_pool: 50}\n",
    )
    settings = demo_only_settings(load_params(project_root / "params.yaml", str(mine)))
    # eps and a task's size are demo-only; min_chars applies to files too (a warning count)
    assert settings == ["ingest.eps = 0.1", "pipeline.tasks.spam.n_pool = 50"]
    assert demo_only_settings(load_params(project_root / "params.yaml", "tiny")) == []


@pytest.fixture
def own_project(tmp_path):
    """A scratch project with the two example tasks under inputs/ and a profile naming them."""
    from tasks.data.example_inputs import write_example_inputs

    write_example_inputs(tmp_path / "inputs")
    write_profile(
        tmp_path / "mine.yaml", "extends: files\npipeline:\n  tasks: !override\n    sport: {}\n    reviews: {}\n"
    )
    return tmp_path


def test_data_check_reads_the_files_up_front(project_root, own_project):
    (own_project / "params.yaml").write_text((project_root / "params.yaml").read_text())
    ok = crucible("data", "check", "--profile", "mine.yaml", cwd=own_project)
    assert ok.returncode == 0, ok.stderr
    assert "inputs/sport: OK (reference 120, pool 300, audit 40, test 120 rows" in ok.stdout
    # a task whose folder is missing: one line naming it and the folders there are
    write_profile(own_project / "typo.yaml", "extends: files\npipeline:\n  tasks: !override\n    sprot: {}\n")
    typo = crucible("data", "check", "--profile", "typo.yaml", cwd=own_project)
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1, typo.stderr
    assert "inputs/sprot: no such folder" in typo.stderr and "has: reviews, sport" in typo.stderr
    # a bad value in one file: the file, the column, the row and the value, before any stage runs
    test = pd.read_parquet(own_project / "inputs" / "reviews" / "test.parquet")
    test.loc[3, "label"] = None
    test.to_parquet(own_project / "inputs" / "reviews" / "test.parquet")
    bad = crucible("params", "check", "--profile", "mine.yaml", cwd=own_project)
    assert bad.returncode == 2
    assert "inputs/reviews/test.parquet, column 'label', row 3" in bad.stderr


@pytest.mark.long
def test_a_failed_run_is_one_error_line_with_the_traceback_in_a_log(tiny_project):
    """A stage that fails inside the flow: `crucible run` prints one `error:` line naming the stage
    and the value, exit 2, and the path of a log that holds the traceback."""
    params = yaml.safe_load((tiny_project / "params.yaml").read_text())
    params["model"]["name"] = str(tiny_project / "no-such-model")
    (tiny_project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = crucible("run", "--stage", "model", cwd=tiny_project)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: stage model: model.name = '{tiny_project / 'no-such-model'}': not a folder, a packaged "
        f"model, or a model in the local Hugging Face cache (nothing is downloaded)"
    ], proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    log = Path(proc.stderr.strip().splitlines()[-1].split(": ", 1)[1])
    assert log.parent == tiny_project / ".crucible" / "logs"
    assert "Traceback (most recent call last)" in log.read_text() and "FileNotFoundError" in log.read_text()


def test_making_the_project_your_own_keeps_the_demo_profiles_and_carries_files_settings(
    project_root, own_project, capsys
):
    """The steps of docs/stages.md (your own data, 6.): params.yaml rendered from your profile holds
    your tasks and every setting of profiles/files.yaml, not only ingest.source; and the demo, the
    profiles built on it and the tests' params (profiles/demo.yaml) stay the demo's, whatever that
    params.yaml says (before, tiny ran the demo tasks beside yours, under source: files)."""
    from flows.cli import build_parser

    assert "crucible params render --profile mine -o params.yaml" in (project_root / "docs" / "stages.md").read_text()
    own, mine = own_project / "params.yaml", own_project / "mine.yaml"
    own.write_text((project_root / "params.yaml").read_text())
    wanted = render_params(own, str(mine))
    args = build_parser().parse_args(["params", "render", str(own), "--profile", str(mine), "-o", str(own)])
    assert args.func(args) == 0, capsys.readouterr().err
    assert render_params(own) == wanted  # every key of the profile run, files.yaml's settings included
    params = load_params(own)
    assert list(params.pipeline.tasks) == ["sport", "reviews"] and params.ingest.source == "files"
    assert (params.finetune.epochs, params.finetune.head_lr, params.quantize.calibration_per_task) == (3.0, 0.01, 32)
    assert list(params.merge.methods) == ["gs3r", "task_arithmetic"]
    # the demo and the profiles on it do not read this params.yaml
    for profile in ("demo", "tiny", "smollm2", "moe"):
        assert render_params(own, profile) == render_params(project_root / "params.yaml", profile), profile
    demo = load_params(own, "demo")
    assert list(demo.pipeline.tasks) == ["bbc", "rotten", "tweets", "trec"] and demo.ingest.source == "demo"
    assert load_params(own, "tiny").finetune.head_lr == demo.finetune.head_lr != params.finetune.head_lr
