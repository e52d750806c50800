"""Using a registered version: load it in this process (`crucible predict`, tests, benchmarks),
serve it over HTTP (`crucible serve`: `mlflow models serve` on 127.0.0.1), describe it, and the
JSON that /invocations takes. The registry itself is written by the register stage (tasks/stages/register.py).
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
    import mlflow.artifacts
    import mlflow.pyfunc

    from tasks.runtime.params import load_params
    from tasks.runtime.tracking import tracking_uri

    import os

    root = Path(root).resolve()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a local copy: no progress bar
    name = name or load_params(root / "params.yaml").tracking.registered_model
    client = registry_client(root)
    mv = resolve_version(client, name, ref)
    # the version's storage location, not models:/...: that would go through the global registry URI
    local = mlflow.artifacts.download_artifacts(artifact_uri=client.get_model_version_download_uri(name, mv.version),
                                                tracking_uri=tracking_uri(root), dst_path=str(dst) if dst else None)
    return mlflow.pyfunc.load_model(local), mv


def version_summary(name: str, mv) -> list[str]:
    """A few lines on a registered version: aliases, kind, hash, gate, accuracy, sizes."""
    t = mv.tags
    lines = [f"{name} version {mv.version}" + (f" (aliases: {', '.join(sorted(mv.aliases))})" if mv.aliases else ""),
             f"model: {t.get('crucible.model_kind', '?')} ({t.get('crucible.variant', '?')}), hash "
             f"{t.get(HASH_TAG, '?')}, run {mv.run_id}"]
    if "crucible.gate.decision" in t:
        lines.append(f"gate at registration: {t['crucible.gate.decision']} ({t.get('crucible.gate.reason', '')})"
                     + (f"; since superseded by version {t['crucible.gate.superseded_by']}"
                        if "crucible.gate.superseded_by" in t else ""))
    accs = {k[len("crucible.metric.accuracy."):]: float(v) for k, v in t.items() if k.startswith("crucible.metric.accuracy.")}
    if accs:
        lines.append("test accuracy: " + ", ".join(f"{k} {v:.4f}" for k, v in accs.items())
                     + f"; mean {float(t.get('crucible.metric.mean_accuracy', 'nan')):.4f}")
    if "crucible.size.served_bytes" in t:
        served, flt = int(t["crucible.size.served_bytes"]), int(t.get("crucible.size.float_bytes", 0))
        lines.append(f"size: {served / 2**20:.1f} MB served" + (f" vs {flt / 2**20:.1f} MB float "
                                                                 f"({served / flt:.1%})" if flt else ""))
    return lines


def serve_command(root: Path, name: str, ref: str, host: str, port: int, workers: int = 1) -> tuple[list[str], dict]:
    """`mlflow models serve` of models:/<name>@<ref> (or /<version>) in this environment, and its
    process environment (the workspace's tracking store)."""
    import os

    from tasks.runtime.tracking import tracking_uri

    uri = f"models:/{name}/{ref}" if str(ref).isdigit() else f"models:/{name}@{ref}"
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", uri, "--env-manager", "local",
           "--host", host, "--port", str(port), "--workers", str(workers)]
    turi = tracking_uri(Path(root).resolve())
    # mlflow starts `uvicorn` by name: this environment's scripts first on PATH
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return cmd, {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": turi, "MLFLOW_REGISTRY_URI": turi,
                 "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def invocation_body(rows: list[tuple[str, str]]) -> dict:
    """The JSON body /invocations takes: dataframe_split with columns text and task."""
    return {"dataframe_split": {"columns": ["text", "task"], "data": [list(r) for r in rows]}}


def curl_example(host: str, port: int, task: str, text: str = "An example text to classify.") -> str:
    body = json.dumps(invocation_body([(text, task)]))
    return (f"curl -s http://{host}:{port}/invocations -H 'Content-Type: application/json' "
            f"-d '{body.replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))}'")


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
