"""Operations end to end on the tiny profile: the scheduled deployments served against a local
Prefect server (started by `crucible deploy` on a free port, stopped by its PID), and two runs on
one workspace at once (a flow against a flow, a flow against `dvc repro`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tasks.registry.serving import free_port
from tasks.runtime.lock import holder

BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.operations]


def _env(root: Path, **extra) -> dict:
    return {**os.environ, "PREFECT_HOME": str(root / ".prefect"), **extra}


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"{what}: the process exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}"
            )
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{log.read_text()[-3000:] if log else ''}")


def _pipeline_runs(root: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("crucible")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [r for r in runs if r.data.tags.get("crucible.kind") == "pipeline"]


def _outputs_match_lock(root: Path, stages: list[str]) -> None:
    tasks = yaml.safe_load((root / "params.yaml").read_text())["pipeline"]["tasks"]
    ids = [f"{s}@{t}" for s in stages for t in tasks]
    out = subprocess.run([str(BIN / "dvc"), "status", *ids, "--json"], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout or "{}") == {}, f"dvc status is not clean: {out.stdout}"


def test_deployment_is_served_with_its_schedule_and_a_triggered_run_completes(tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    log = tmp_path / "deploy.log"
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [str(BIN / "crucible"), "deploy", "--port", str(port), "--root", str(root)],
            cwd=root,
            env=_env(root),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    env = _env(root, PREFECT_API_URL=api)

    def deployment(name: str) -> dict | None:
        proc = subprocess.run(
            [str(BIN / "prefect"), "deployment", "inspect", f"crucible-scheduled/{name}", "--output", "json"],
            env=env,
            capture_output=True,
            text=True,
        )
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    try:
        nightly = _wait("the nightly deployment", lambda: deployment("nightly"), 240, serve, log)
        assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 3 * * *"]
        assert nightly["schedules"][0]["schedule"]["timezone"] == "UTC"
        assert nightly["global_concurrency_limit"]["limit"] == 1
        assert nightly["concurrency_options"]["collision_strategy"] == "ENQUEUE"
        assert nightly["parameters"]["root"] == str(root)
        run = subprocess.run(
            [
                str(BIN / "prefect"),
                "deployment",
                "run",
                "crucible-scheduled/on-demand",
                "--param",
                'stages=["ingest"]',
                "--watch",
                "--watch-timeout",
                "300",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Completed" in run.stdout
        runs = _pipeline_runs(root)
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
        assert all(
            (root / "metrics" / t / "ingest.json").is_file()
            for t in yaml.safe_load((root / "params.yaml").read_text())["pipeline"]["tasks"]
        )
    finally:
        serve.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            code = serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    leftover = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes left after Ctrl-C: {leftover}"


def test_second_run_waits_and_dvc_repro_refuses_while_a_flow_runs(tmp_path, project_root):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, tmp_path / "ws", "tiny", overrides={"pipeline": {"lock_timeout": 240}})
    logs = {name: tmp_path / f"{name}.log" for name in ("first", "second")}
    procs = {}
    with open(logs["first"], "w") as out:
        procs["first"] = subprocess.Popen(
            [str(BIN / "crucible"), "run", "--stage", "ingest", "--stage", "embed"],
            cwd=root,
            env=_env(root),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    live = _wait("the first flow takes the workspace", lambda: holder(root), 240, procs["first"], logs["first"])
    assert live.kind == "flow" and live.pid == procs["first"].pid
    with open(logs["second"], "w") as out:
        procs["second"] = subprocess.Popen(
            [str(BIN / "crucible"), "run", "--stage", "ingest"],
            cwd=root,
            env=_env(root),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _wait(
        "the second flow says it waits",
        lambda: "waiting up to 240 s" in logs["second"].read_text(),
        120,
        procs["second"],
        logs["second"],
    )
    assert f"the workspace is locked by pid {live.pid}" in logs["second"].read_text()
    # dvc repro beside the flow: its first stage refuses at once (waiting would deadlock on DVC's lock)
    repro = subprocess.run(
        [str(BIN / "dvc"), "repro"], cwd=root, env=_env(root), capture_output=True, text=True, timeout=240
    )
    assert procs["first"].poll() is None, "the first flow should still be running"
    assert repro.returncode != 0
    assert f"the workspace is locked by pid {live.pid}" in repro.stderr + repro.stdout
    assert "runs under `dvc repro`" in repro.stderr + repro.stdout
    for name in ("first", "second"):
        assert procs[name].wait(timeout=400) == 0, logs[name].read_text()[-3000:]
    second = logs["second"].read_text()
    assert "ingest@bbc                   up to date" in second  # it ran after the first, which did the work
    _outputs_match_lock(root, ["ingest", "embed"])  # the first run's outputs are intact and recorded
    assert holder(root) is None
