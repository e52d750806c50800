"""prefect.yaml points at real flows, and dvc.yaml's stages at real stage modules."""

import importlib
from pathlib import Path

import yaml
from prefect.flows import Flow

from tasks.stage import STAGES


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
