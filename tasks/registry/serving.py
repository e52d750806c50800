"""Using a registered version: load it in this process (`crucible predict`, tests, benchmarks),
serve it over HTTP (`crucible serve`: MLflow's scoring app behind request limits, under uvicorn on
127.0.0.1; tasks/registry/serving_app.py), describe it, and the JSON that /invocations takes. The
registry itself is written by the register stage (tasks/stages/register.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.registry.registry import CHAMPION, HASH_TAG, resolve_version


def registry_client(root: Path):
    from mlflow.tracking import MlflowClient

    from tasks.runtime.tracking import tracking_uri

    uri = tracking_uri(Path(root).resolve())
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def load_registered(root: Path, ref: str = CHAMPION, name: str | None = None, dst: Path | None = None):
    """(pyfunc model, model version) of `name` (default: params' tracking.registered_model) at
    version or alias `ref`, loaded in this process without touching the global tracking URI."""
    import os

    import mlflow.artifacts
    import mlflow.pyfunc

    from tasks.runtime.params import load_params
    from tasks.runtime.tracking import tracking_uri

    root = Path(root).resolve()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a local copy: no progress bar
    name = name or load_params(root / "params.yaml").tracking.registered_model
    client = registry_client(root)
    mv = resolve_version(client, name, ref)
    # the version's storage location, not models:/...: that would go through the global registry URI
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=client.get_model_version_download_uri(name, mv.version),
        tracking_uri=tracking_uri(root),
        dst_path=str(dst) if dst else None,
    )
    return mlflow.pyfunc.load_model(local), mv


def version_summary(name: str, mv) -> list[str]:
    """A few lines on a registered version: aliases, kind, hash, gate, accuracy, sizes."""
    t = mv.tags
    lines = [
        f"{name} version {mv.version}" + (f" (aliases: {', '.join(sorted(mv.aliases))})" if mv.aliases else ""),
        f"model: {t.get('crucible.model_kind', '?')} ({t.get('crucible.variant', '?')}), hash "
        f"{t.get(HASH_TAG, '?')}, run {mv.run_id}",
    ]
    made = ([f"in DVC experiment {t['crucible.experiment']!r}"] if t.get("crucible.experiment") else []) + (
        [f"from a {'dirty' if t['crucible.git_dirty'] == 'true' else 'clean'} git work tree"]
        if t.get("crucible.git_dirty") in ("true", "false")
        else []
    )
    if made:
        lines.append("made " + ", ".join(made))
    if "crucible.gate.decision" in t:
        lines.append(
            f"gate at registration: {t['crucible.gate.decision']} ({t.get('crucible.gate.reason', '')})"
            + (
                f"; since superseded by version {t['crucible.gate.superseded_by']}"
                if "crucible.gate.superseded_by" in t
                else ""
            )
        )
    accs = {
        k[len("crucible.metric.accuracy.") :]: float(v)
        for k, v in t.items()
        if k.startswith("crucible.metric.accuracy.")
    }
    if accs:
        lines.append(
            "test accuracy: "
            + ", ".join(f"{k} {v:.4f}" for k, v in accs.items())
            + f"; mean {float(t.get('crucible.metric.mean_accuracy', 'nan')):.4f}"
        )
    if "crucible.size.served_bytes" in t:
        served, flt = int(t["crucible.size.served_bytes"]), int(t.get("crucible.size.float_bytes", 0))
        lines.append(
            f"size: {served / 2**20:.1f} MB served"
            + (f" vs {flt / 2**20:.1f} MB float ({served / flt:.1%})" if flt else "")
        )
    return lines


def download_version(root: Path, name: str, version: str, dst: Path) -> Path:
    """The files of version `version` of `name` copied from the workspace's registry into the
    folder `dst`; returns the model folder (what MLflow's loaders and the serving app take)."""
    import os

    import mlflow.artifacts

    from tasks.runtime.tracking import tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    client = registry_client(root)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=client.get_model_version_download_uri(name, str(version)),
        tracking_uri=tracking_uri(Path(root).resolve()),
        dst_path=str(dst),
    )
    return Path(local)


def serve_limits(params) -> dict:
    """The request limits of params' `serve` section, as the serving app reads them."""
    return params.serve.model_dump()


def serve_command(model_dir: Path, host: str, port: int, limits: dict, workers: int = 1) -> tuple[list[str], dict]:
    """uvicorn running tasks.registry.serving_app (MLflow's scoring app for the model folder
    `model_dir`, behind the request and connection limits of params' serve section:
    tasks/registry/serving_http.py) in this environment, and its process environment (each worker
    prints `ready: http://host:port` once it answers)."""
    import json
    import os

    from tasks.registry import serving_app, serving_http

    code_root = str(Path(serving_app.__file__).resolve().parents[2])  # where `tasks` imports from
    cmd = [sys.executable, "-m", serving_http.__name__, "--host", host, "--port", str(port), "--workers", str(workers)]
    path = os.pathsep.join([code_root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return cmd, {
        **os.environ,
        "PYTHONPATH": path,
        serving_app.MODEL_ENV: str(Path(model_dir).resolve()),
        serving_app.LIMITS_ENV: json.dumps({k: int(limits[k]) for k in serving_app.LIMITS}),
        serving_app.ANNOUNCE_ENV: f"http://{host}:{port}",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }


def invocation_body(rows: list[tuple[str, str]]) -> dict:
    """The JSON body /invocations takes: dataframe_split with columns text and task."""
    return {"dataframe_split": {"columns": ["text", "task"], "data": [list(r) for r in rows]}}


def curl_example(host: str, port: int, task: str, text: str = "An example text to classify.") -> str:
    body = json.dumps(invocation_body([(text, task)]))
    return (
        f"curl -s http://{host}:{port}/invocations -H 'Content-Type: application/json' "
        f"-d '{body.replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))}'"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for tests and benchmarks)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until_serving(url: str, proc, timeout: float, log: Path | None = None, path: str = "/ping") -> float:
    """Poll `<url><path>` until the server answers; seconds it took. RuntimeError (with the log's
    tail) if the server process exits first or nothing answers within `timeout`."""
    import time
    import urllib.request

    def tail() -> str:
        return f":\n{Path(log).read_text()[-3000:]}" if log and Path(log).exists() else ""

    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering on {url}{tail()}")
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"no answer on {url}{path} in {timeout:.0f} s{tail()}")
        time.sleep(0.5)


def stop_server(proc, timeout: float = 20) -> None:
    """Stop a server started with start_new_session=True: SIGTERM to its process group, SIGKILL if
    it has not exited within `timeout`."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
