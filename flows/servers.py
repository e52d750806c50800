"""The `crucible` commands that start servers and keep running until Ctrl-C: `ui` (the MLflow UI and
a Prefect server), `deploy` (the scheduled deployments on a Prefect server) and `serve` (the
registered model over HTTP). Every server binds 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.children import spawn, stop_group
from flows.registry_cli import check_device, message, registered


def cmd_ui(args) -> int:
    from tasks.runtime.tracking import TrackingStoreError, tracking_uri

    root = Path(args.root).resolve()
    try:
        uri = tracking_uri(root)
    except TrackingStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    procs = [  # each in its own process group, watched: a killed `crucible ui` leaves no server behind
        spawn(
            [
                sys.executable,
                "-m",
                "mlflow",
                "ui",
                "--backend-store-uri",
                uri,
                "--default-artifact-root",
                (root / "mlartifacts").as_uri(),
                "--host",
                "127.0.0.1",
                "--port",
                str(args.mlflow_port),
            ]
        ),
        spawn(
            [
                str(Path(sys.executable).with_name("prefect")),
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(args.prefect_port),
            ]
        ),
    ]
    print(f"MLflow UI:      http://127.0.0.1:{args.mlflow_port}")
    print(
        f"Prefect server: http://127.0.0.1:{args.prefect_port}  (point flows at it with "
        f"PREFECT_API_URL=http://127.0.0.1:{args.prefect_port}/api)"
    )
    print("Ctrl-C stops both.")
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:  # as Ctrl-C would: the whole group (the MLflow UI runs its server in a child)
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        for p in procs:
            stop_group(p, None, timeout=10)
    return 0


def _prefect_answers(api: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def cmd_deploy(args) -> int:
    """A Prefect server on 127.0.0.1 (unless PREFECT_API_URL names one, or one already answers on
    the port) and a process serving prefect.yaml's deployments; Ctrl-C stops both."""
    from flows.deploy import flow_name, load_spec
    from tasks.registry.serving import wait_until_serving

    root = Path(args.root).resolve()
    try:
        deployments = load_spec(root)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api = os.environ.get("PREFECT_API_URL") or f"http://{args.host}:{args.port}/api"
    env = {**os.environ, "PREFECT_API_URL": api}
    server = None
    procs = []
    try:
        if _prefect_answers(api):
            print(f"using the Prefect server at {api}")
        elif os.environ.get("PREFECT_API_URL"):
            print(f"error: PREFECT_API_URL={api} does not answer", file=sys.stderr)
            return 2
        else:
            log = root / ".prefect" / "server.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                server = spawn(
                    [
                        str(Path(sys.executable).with_name("prefect")),
                        "server",
                        "start",
                        "--host",
                        args.host,
                        "--port",
                        str(args.port),
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            procs.append(server)
            print(f"starting a Prefect server on {args.host}:{args.port} (log: {log}) ...", flush=True)
            wait_until_serving(api, server, args.timeout, log, path="/health")
        serving = spawn([sys.executable, "-m", "flows.deploy", "--root", str(root)], cwd=root, env=env)
        procs.append(serving)
        ui = api.removesuffix("/api")
        print(
            f"serving {len(deployments)} deployments from {root}: "
            + ", ".join(
                f"{flow_name(d)}/{d['name']}"
                + "".join(f" ({s['cron']} {s.get('timezone', 'UTC')})" for s in d.get("schedules") or [])
                for d in deployments
            )
        )
        print(
            f"Prefect UI: {ui}   trigger a run:  PREFECT_API_URL={api} prefect deployment run "
            f"{flow_name(deployments[-1])}/{deployments[-1]['name']}"
        )
        print("Ctrl-C stops the deployments and the server.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        failed = next(p for p in procs if p.poll() is not None)
        print(
            f"error: {'the Prefect server' if failed is server else 'serving'} exited with {failed.returncode}",
            file=sys.stderr,
        )
        return 1
    except RuntimeError as exc:  # the server did not come up
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in reversed(procs):  # the serving process first (it pauses its schedules), then the server
            stop_group(p, signal.SIGINT, timeout=20)  # as Ctrl-C: Prefect's serve shuts down cleanly


def exposure_warning(host: str) -> str | None:
    """What binding `host` means when it is not a loopback address (it, or every address its name
    resolves to, in 127.0.0.0/8 or ::1); None for one that is."""
    import ipaddress
    import socket

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        addresses = set()
    try:
        if addresses and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
            return None
    except ValueError:
        pass
    return (
        f"WARNING: --host {host} is not a loopback address: the server exposes the model to the network, "
        f"with no authentication and no TLS; anyone who can reach its port can call it. Leave out --host "
        f"(127.0.0.1) unless a proxy or firewall in front of it decides who can"
    )


def cmd_serve(args) -> int:
    """The registered version (alias or number) over HTTP: its files copied from the workspace's
    registry into a scratch folder of this process (.crucible/tmp/serve-<pid>@<host>-*), then this
    process becomes the server (exec): uvicorn running MLflow's scoring app behind the request limits
    of params' serve section (tasks/registry/serving_app.py), which says `ready` once it answers and
    stops on Ctrl-C or SIGTERM. One process, not a launcher beside the worker; the folder goes at the
    next sweep once the server is gone (the next `crucible serve` or stage start)."""
    import os
    import shutil
    import socket
    import tempfile

    from mlflow.exceptions import MlflowException

    from tasks.registry.serving import curl_example, download_version, serve_command, serve_limits
    from tasks.runtime.params import ParamsError, load_params
    from tasks.runtime.scratch import SCRATCH, owner_tag, sweep
    from tasks.runtime.tracking import TrackingStoreError

    warning = exposure_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    root = Path(args.root).resolve()
    try:
        check_device()  # the server's workers load the model there: a device that is not there, now
        name, _, mv = registered(root, args.alias)
        limits = serve_limits(load_params(root / "params.yaml"))
    except (ParamsError, KeyError, ValueError, TrackingStoreError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            sock.bind((args.host, args.port))
        except OSError as exc:
            print(
                f"error: cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port",
                file=sys.stderr,
            )
            return 2
    sweep(root)  # the copies of servers that are gone
    (root / SCRATCH).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"serve-{owner_tag()}-", dir=root / SCRATCH))
    try:
        model_dir = download_version(root, name, mv.version, folder)
    except (MlflowException, OSError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        print(
            f"error: cannot read the files of {name} version {mv.version} from the registry: {message(exc)}",
            file=sys.stderr,
        )
        return 2
    cmd, env = serve_command(model_dir, args.host, args.port, limits, args.workers)
    tasks = (mv.tags.get("crucible.tasks") or "TASK").split(",")
    print(
        f"serving {name} version {mv.version} (@{args.alias}) at http://{args.host}:{args.port}/invocations "
        f"(tasks: {', '.join(tasks)}); Ctrl-C stops it."
    )
    print(
        f"limits per request: {limits['max_rows']} rows (serve.max_rows), {limits['max_chars']} characters per "
        f"text (serve.max_chars), {limits['max_body_bytes']} bytes of body (serve.max_body_bytes); "
        f"{limits['max_concurrency']} connections and requests in flight per worker (serve.max_concurrency), "
        f"{limits['client_timeout']} s to send a request's headers, then its body (serve.client_timeout)"
    )
    print("try:")
    print(f"  {curl_example(args.host, args.port, tasks[0])}")
    print(f'  # -> {{"predictions": [{{"task": "{tasks[0]}", "label": ..., "proba_<class>": ...}}]}}', flush=True)
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # this process becomes the server: its pid, its scratch folder
