"""The runtime section (device and precision): resolved before a stage writes anything, recorded on
its MLflow run, never a DVC dependency. On this CPU machine: `auto` is the CPU, an explicit `cpu`
gives the same bytes, and a CUDA device that is not there stops the stage with nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from crucible.device import DeviceUnavailable
from tasks.runtime.io import md5_file
from tasks.stages import execute, specs


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """Every test here sees a machine without CUDA, whatever machine runs it (in this process and in
    the commands it starts)."""
    import crucible.device

    monkeypatch.setattr(crucible.device, "visible_cuda", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


EMBEDDINGS = Path("data") / "trec" / "embeddings.safetensors"


def set_runtime(root: Path, **values) -> None:
    data = yaml.safe_load((root / "params.yaml").read_text())
    data.setdefault("runtime", {}).update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def runs(root: Path, stage: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("crucible")
    return client.search_runs([exp.experiment_id], f"tags.`crucible.stage` = '{stage}'") if exp else []


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, project_root):
    import crucible.device
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path_factory.mktemp("runtime"), "tiny")
    with pytest.MonkeyPatch.context() as mp:  # auto resolves to the CPU, as on a machine without CUDA
        mp.setattr(crucible.device, "visible_cuda", lambda: 0)
        execute("model", None, root)
        execute("ingest", "trec", root)
        execute("embed", "trec", root)
    return root


def test_auto_is_the_cpu_here_and_is_recorded_on_the_run(embedded):
    (run,) = runs(embedded, "embed")
    tags = run.data.tags
    assert tags["crucible.runtime.device"] == "cpu" and tags["crucible.runtime.precision"] == "fp32"
    assert tags["crucible.runtime.torch"] == torch.__version__ and tags["crucible.runtime.cuda"] == str(
        torch.version.cuda or "none"
    )


def test_cpu_asked_for_explicitly_or_by_the_environment_gives_the_same_bytes(embedded, monkeypatch):
    before = md5_file(embedded / EMBEDDINGS)
    set_runtime(embedded, device="cpu", precision="fp32")
    try:
        assert md5_file(embedded / EMBEDDINGS) == before
        execute("embed", "trec", embedded)
        assert md5_file(embedded / EMBEDDINGS) == before
        set_runtime(embedded, device="auto", precision="auto")
        monkeypatch.setenv("CRUCIBLE_DEVICE", "cpu")
        execute("embed", "trec", embedded)
        assert md5_file(embedded / EMBEDDINGS) == before
    finally:
        set_runtime(embedded, device="auto", precision="auto")


@pytest.mark.parametrize("how", ["params", "env"])
def test_cuda_without_a_gpu_stops_the_stage_before_it_writes_anything(embedded, monkeypatch, how):
    path = embedded / EMBEDDINGS
    before, mtime, n_runs = md5_file(path), path.stat().st_mtime_ns, len(runs(embedded, "embed"))
    if how == "params":
        set_runtime(embedded, device="cuda")
        setting = "runtime.device = 'cuda'"
    else:
        monkeypatch.setenv("CRUCIBLE_DEVICE", "cuda:1")
        setting = "CRUCIBLE_DEVICE = 'cuda:1'"
    try:
        with pytest.raises(DeviceUnavailable) as err:
            execute("embed", "trec", embedded)
    finally:
        set_runtime(embedded, device="auto")
    assert setting in str(err.value) and "no CUDA device is visible" in str(err.value)
    assert md5_file(path) == before and path.stat().st_mtime_ns == mtime
    assert len(runs(embedded, "embed")) == n_runs, "no MLflow run is opened for a stage that cannot start"


def test_the_command_says_so_in_one_line_and_exits_2(embedded):
    set_runtime(embedded, device="cuda")
    try:
        proc = subprocess.run(
            [
                str(Path(sys.executable).with_name("crucible")),
                "stage",
                "embed",
                "--task",
                "trec",
                "--root",
                str(embedded),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        set_runtime(embedded, device="auto")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage embed@trec: runtime.device = 'cuda', but no CUDA device is visible"), last


def test_the_runtime_is_no_stage_dependency(project_root):
    """Moving a workspace onto a GPU must not rerun it: no stage declares runtime, dvc.yaml lists none."""
    for spec in specs():
        assert not any(p == "runtime" or p.startswith("runtime.") for p in spec.params), spec.name
    dvc = yaml.safe_load((project_root / "dvc.yaml").read_text())
    for name, stage in dvc["stages"].items():
        for entry in stage.get("params", []):
            keys = entry if isinstance(entry, str) else next(iter(entry.values()))
            keys = [keys] if isinstance(keys, str) else keys
            assert not any(str(k).startswith("runtime") for k in keys), name


def test_bad_values_are_refused_with_the_setting_named(monkeypatch):
    from tasks.runtime.device import resolve

    with pytest.raises(ValueError, match=r"CRUCIBLE_DEVICE = 'tpu'"):
        resolve(None, {"CRUCIBLE_DEVICE": "tpu"})
    with pytest.raises(ValueError, match=r"CRUCIBLE_PRECISION = 'fp8'"):
        resolve(None, {"CRUCIBLE_PRECISION": "fp8"})
    assert resolve(None, {"CRUCIBLE_DEVICE": "cpu", "CRUCIBLE_PRECISION": "bf16"}).precision == "bf16"
    assert resolve(None, {"CRUCIBLE_DEVICE": "cpu"}).precision == "fp32"  # auto on a CPU


def test_the_params_section_validates(tmp_path, project_root):
    from tasks.runtime.params import ParamsError, load_params

    data = yaml.safe_load((project_root / "params.yaml").read_text())
    for bad in ({"device": "gpu"}, {"device": "cuda:x"}, {"precision": "fp16"}):
        data["runtime"] = {"device": "auto", "precision": "auto", **bad}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        with pytest.raises(ParamsError, match="runtime"):
            load_params(tmp_path / "params.yaml")
