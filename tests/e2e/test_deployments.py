"""prefect.yaml points at real flows, and dvc.yaml's stages at real stage modules."""

import importlib
from pathlib import Path

import yaml
from prefect.flows import Flow

from tasks.stages import NAMES as STAGES


def test_prefect_deployments_resolve(project_root: Path):
    spec = yaml.safe_load((project_root / "prefect.yaml").read_text())
    assert spec["deployments"], "no deployments"
    for dep in spec["deployments"]:
        path, name = dep["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert isinstance(getattr(module, name), Flow), dep["entrypoint"]
        for schedule in dep.get("schedules", []):
            assert len(schedule["cron"].split()) == 5


def test_dvc_stages_are_registered_stages(project_root: Path):
    spec = yaml.safe_load((project_root / "dvc.yaml").read_text())
    for name, stage in spec["stages"].items():
        assert name in STAGES
        cmd = stage.get("do", stage)["cmd"]
        assert cmd.startswith(f"crucible stage {name}")
        for dep in stage.get("do", stage)["deps"]:
            if dep == "data" or dep.startswith(("data/", "models/", "metrics/")):
                continue  # another stage's output (absent on a fresh clone)
            assert (project_root / dep).exists(), f"dvc.yaml: stage {name} lists a missing dep {dep}"


def test_deploy_builds_the_schedules_and_limits_of_prefect_yaml(project_root: Path):
    from flows.deploy import build_deployments, load_spec

    deps = {d.name: d for d in build_deployments(project_root)}
    assert set(deps) == {d["name"] for d in load_spec(project_root)} == {"nightly", "on-demand"}
    nightly = deps["nightly"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    assert nightly.concurrency_limit == 1
    assert nightly.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert nightly.parameters["root"] == str(project_root.resolve())  # absolute: runs execute elsewhere


def test_deploy_refuses_a_bad_prefect_yaml(tmp_path: Path):
    import pytest

    from flows.deploy import load_spec

    with pytest.raises(FileNotFoundError, match="no prefect.yaml"):
        load_spec(tmp_path)
    bad = {
        "deployments": [{"name": "n", "entrypoint": "flows/pipeline.py:scheduled", "schedules": [{"cron": "0 3 * *"}]}]
    }
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(
        ValueError, match=r"deployments\[0\].schedules\[0\].cron must be a 5-field cron string, got '0 3 \* \*'"
    ):
        load_spec(tmp_path)
    bad["deployments"][0].update(schedules=[], concurrency_limit={"limit": 1, "collision_strategy": "DROP"})
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="collision_strategy must be one of ENQUEUE, CANCEL_NEW, got 'DROP'"):
        load_spec(tmp_path)


def test_task_runners_follow_params(monkeypatch):
    import pytest
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.pipeline import task_runner
    from tasks.runtime.params import load_params

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")

    def with_pipeline(**kw):
        return params.model_copy(update={"pipeline": params.pipeline.model_copy(update=kw)})

    runner = task_runner(with_pipeline(runner="threads", max_workers=3))
    assert isinstance(runner, ThreadPoolTaskRunner) and runner._max_workers == 3
    prefect_dask = pytest.importorskip("prefect_dask")
    runner = task_runner(with_pipeline(runner="dask", max_workers=2))
    assert isinstance(runner, prefect_dask.DaskTaskRunner)
    assert runner.cluster_kwargs["n_workers"] == 2 and runner.cluster_kwargs["threads_per_worker"] == 1
    runner = task_runner(with_pipeline(runner="dask", address="tcp://10.0.0.1:8786"))
    assert runner.address == "tcp://10.0.0.1:8786"
    monkeypatch.setenv("CRUCIBLE_DASK_ADDRESS", "tcp://10.0.0.2:8786")  # the environment wins
    assert task_runner(with_pipeline(runner="dask", address="tcp://10.0.0.1:8786")).address == "tcp://10.0.0.2:8786"


def test_a_missing_runner_integration_names_the_extra(monkeypatch):
    import sys

    import pytest

    from flows.pipeline import task_runner
    from tasks.runtime.params import load_params

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    for runner in ("dask", "ray"):
        monkeypatch.setitem(sys.modules, f"prefect_{runner}", None)  # as if not installed
        p = params.model_copy(update={"pipeline": params.pipeline.model_copy(update={"runner": runner})})
        with pytest.raises(ImportError, match=rf"needs prefect-{runner}: pip install -e '.\[{runner}\]'"):
            task_runner(p)
