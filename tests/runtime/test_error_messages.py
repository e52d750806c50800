"""Errors say what is wrong and where, in one line with exit 2: a params file that is not UTF-8, a
garbage base-model manifest, a profile that adds its tasks to the inherited ones (a forgotten
`!override`), a registry command run where there is no tracking store (it creates none), and serve
or predict asked for a device that is not there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.runtime.params import ParamsError, load_params


def _crucible(capsys, *argv: str) -> tuple[int, str]:
    from flows.cli import build_parser

    args = build_parser().parse_args(list(argv))
    code = args.func(args)
    return code, capsys.readouterr().err


@pytest.fixture
def project(tmp_path, project_root) -> Path:
    """A project folder with the repo's params.yaml and nothing else."""
    shutil.copy(project_root / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def test_a_params_file_that_is_not_utf8_is_named(project, capsys):
    path = project / "params.yaml"
    path.write_bytes(path.read_bytes() + "# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ParamsError, match=rf"^{path}: not UTF-8 text \(byte 0xe9 on line \d+\); save it as UTF-8$"):
        load_params(path)
    code, err = _crucible(capsys, "params", "check", str(path))
    assert code == 2 and err.startswith(f"error: {path}: not UTF-8 text") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b"{not json", b"[]", b'{"name": "all-MiniLM-L6-v2"}'])
def test_a_garbage_base_model_manifest_is_named_with_its_rebuild(project, content):
    from tasks.data.models import base_model

    path = project / "models" / "base" / "manifest.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        base_model(load_params(project / "params.yaml"), project, check=False)
    message = str(err.value)
    assert message.startswith(f"{path}: not a manifest") and "crucible stage model" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("extends", [None, "files"])
def test_a_profile_that_adds_tasks_without_override_says_so(project, capsys, extends):
    profile = project / "mine.yaml"
    profile.write_text(
        (f"extends: {extends}\n" if extends else "ingest:\n  source: files\n") + "pipeline:\n  tasks:\n    spam: {}\n"
    )
    (project / "inputs" / "spam").mkdir(parents=True)  # the user's one task is there
    inherited = "profile files (sport, reviews)" if extends else "params.yaml (bbc, rotten, tweets, trec)"
    for argv in (["data", "check"], ["run", "--workspace", str(project / "ws")]):
        code, err = _crucible(capsys, *argv, "--profile", str(profile), "--root", str(project))
        assert code == 2, err
        assert err.startswith(f"error: {profile}: pipeline.tasks adds spam to the tasks of {inherited} instead"), err
        assert "`tasks: !override`" in err and len(err.splitlines()) == 1, err
    assert not (project / "ws").exists()
    profile.write_text(profile.read_text().replace("tasks:", "tasks: !override"))  # as the message says
    code, err = _crucible(capsys, "data", "check", "--profile", str(profile), "--root", str(project))
    assert code == 2 and err.startswith(f"error: {project / 'inputs' / 'spam'}"), err  # on to the files


@pytest.mark.parametrize("command", [["predict", "--task", "bbc", "a text"], ["lineage", "champion"]])
def test_reading_the_registry_where_there_is_no_store_creates_none(project, capsys, monkeypatch, command):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (project / "build" / "tiny").mkdir(parents=True)
    (project / "build" / "tiny" / "mlflow.db").write_bytes(b"a profile's store")
    code, err = _crucible(capsys, *command, "--root", str(project))
    assert code == 2, err
    assert err == (
        f"error: {project / 'mlflow.db'}: no MLflow tracking store there, so no registered model to read; a "
        "profile's run tracks in its own workspace: pass --root build/tiny\n"
    )
    assert not (project / "mlflow.db").exists()


@pytest.mark.parametrize("command", [["predict", "--task", "bbc", "a text"], ["serve", "--port", "1"]])
def test_serve_and_predict_on_a_device_that_is_not_there(project, capsys, monkeypatch, command):
    monkeypatch.setenv("CRUCIBLE_DEVICE", "cuda:99")
    code, err = _crucible(capsys, *command, "--root", str(project))
    assert code == 2, err
    assert err.startswith("error: CRUCIBLE_DEVICE = 'cuda:99', but ") and len(err.splitlines()) == 1, err
    assert not (project / "mlflow.db").exists()
