"""The `crucible` command.

    crucible run [--profile tiny] [--stage ingest ...]   the pipeline as a Prefect flow
    crucible stage ingest --task bbc                     one stage (what dvc.yaml runs)
    crucible dag write|check|show                        dvc.yaml from the stages' declarations
    crucible params check [FILE] [--profile tiny]        validate params
    crucible params render [--profile tiny] [-o FILE]    params with a profile applied
    crucible ui                                          MLflow UI + Prefect server on 127.0.0.1
    crucible deploy [--port 4200]                        serve the scheduled deployments (make serve)
    crucible serve [--alias champion] [--port 5001]      the registered model over HTTP on 127.0.0.1
    crucible predict --task bbc "text" ...               the registered champion, in this process
    crucible lineage champion|VERSION                    what made a registered version; still current?
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks.runtime.env import apply_defaults


def _cmd_params(args) -> int:
    from tasks.runtime.params import ParamsError, load_params, render_params

    import yaml

    try:
        if args.action == "check":
            params = load_params(args.file, args.profile)
            print(f"{args.file}{' + profile ' + args.profile if args.profile else ''}: OK "
                  f"({len(params.pipeline.tasks)} tasks: {', '.join(params.pipeline.tasks)})")
        else:
            data = render_params(args.file, args.profile)
            load_params(args.file, args.profile)
            text = yaml.safe_dump(data, sort_keys=False)
            if args.output:
                Path(args.output).write_text(text)
            else:
                sys.stdout.write(text)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_stage(args) -> int:
    from tasks.runtime.lock import WorkspaceLocked
    from tasks.runtime.params import ParamsError
    from tasks.stages import execute

    try:
        result = execute(args.stage, args.task, args.root)
    except WorkspaceLocked as exc:
        print(f"error: stage {args.stage}{'@' + args.task if args.task else ''}: {exc}", file=sys.stderr)
        return 3
    except (ParamsError, FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
        print(f"error: stage {args.stage}{'@' + args.task if args.task else ''}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2, default=str))
    return 0


def _cmd_dag(args) -> int:
    """dvc.yaml from the stages' declarations: write it, check it, or show the DAG of stage runs."""
    from tasks.runtime.declaration import upstream
    from tasks.runtime.params import ParamsError, load_params
    from tasks.stages import dvc_yaml, specs

    root = Path(args.root).resolve()
    path = root / "dvc.yaml"
    if args.action == "write":
        text = dvc_yaml()
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path}")
        else:
            print(f"{path} is up to date")
        return 0
    if args.action == "check":
        if not path.is_file() or path.read_text() != dvc_yaml():
            print(f"error: {path} is stale: it differs from the stages' declarations (tasks/stages/*.py); "
                  f"run `crucible dag write`", file=sys.stderr)
            return 1
        print(f"{path} matches the stages' declarations")
        return 0
    try:
        tasks = list(load_params(root / "params.yaml").pipeline.tasks)
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sid, ups in upstream(specs(), tasks).items():
        print(f"{sid:<24} <- {', '.join(sorted(ups)) or '(nothing)'}")
    return 0


def _cmd_run(args) -> int:
    from tasks.runtime.params import ParamsError, load_params

    root = Path(args.root).resolve()
    try:
        if args.profile:
            from tasks.runtime.workspace import make_workspace

            root = make_workspace(root, args.workspace or root / "build" / Path(args.profile).stem, args.profile)
            apply_defaults(root)
            print(f"profile {args.profile}: running in {root}")
        load_params(root / "params.yaml")
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from flows.pipeline import run_pipeline
    from tasks.runtime.lock import WorkspaceLocked

    start = time.perf_counter()
    try:
        results = run_pipeline(root, args.stage or None)
    except WorkspaceLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    print(f"\npipeline finished in {time.perf_counter() - start:.1f} s ({root})")
    for sid, res in results.items():
        status = "up to date" if res == "skipped" else f"ran in {res['seconds']:.1f} s"
        print(f"  {sid:<28} {status}")
    return 0


def _cmd_ui(args) -> int:
    from tasks.runtime.tracking import tracking_uri

    root = Path(args.root).resolve()
    procs = [
        subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(root),
                          "--default-artifact-root", (root / "mlartifacts").as_uri(),
                          "--host", "127.0.0.1", "--port", str(args.mlflow_port)]),
        subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start",
                          "--host", "127.0.0.1", "--port", str(args.prefect_port)]),
    ]
    print(f"MLflow UI:      http://127.0.0.1:{args.mlflow_port}")
    print(f"Prefect server: http://127.0.0.1:{args.prefect_port}  (point flows at it with "
          f"PREFECT_API_URL=http://127.0.0.1:{args.prefect_port}/api)")
    print("Ctrl-C stops both.")
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


def _prefect_answers(api: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _cmd_deploy(args) -> int:
    """A Prefect server on 127.0.0.1 (unless PREFECT_API_URL names one, or one already answers on
    the port) and a process serving prefect.yaml's deployments; Ctrl-C stops both."""
    import os

    from flows.deploy import flow_name, load_spec
    from tasks.registry.serving import stop_server, wait_until_serving

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
                server = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start",
                                           "--host", args.host, "--port", str(args.port)], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(server)
            print(f"starting a Prefect server on {args.host}:{args.port} (log: {log}) ...", flush=True)
            wait_until_serving(api, server, args.timeout, log, path="/health")
        serving = subprocess.Popen([sys.executable, "-m", "flows.deploy", "--root", str(root)], cwd=root,
                                   env=env, start_new_session=True)
        procs.append(serving)
        ui = api.removesuffix("/api")
        print(f"serving {len(deployments)} deployments from {root}: "
              + ", ".join(f"{flow_name(d)}/{d['name']}"
                          + "".join(f" ({s['cron']} {s.get('timezone', 'UTC')})" for s in d.get("schedules") or [])
                          for d in deployments))
        print(f"Prefect UI: {ui}   trigger a run:  PREFECT_API_URL={api} prefect deployment run "
              f"{flow_name(deployments[-1])}/{deployments[-1]['name']}")
        print("Ctrl-C stops the deployments and the server.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        failed = next(p for p in procs if p.poll() is not None)
        print(f"error: {'the Prefect server' if failed is server else 'serving'} exited with {failed.returncode}",
              file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the server did not come up
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in reversed(procs):  # the serving process first (it pauses its schedules), then the server
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGINT)  # as Ctrl-C: Prefect's serve shuts down cleanly
                    p.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            if p.poll() is None:
                stop_server(p, timeout=20)


def _message(exc: Exception) -> str:
    """An error's message without KeyError's quotes or MLflow's wrapping."""
    message = getattr(exc, "message", None)
    if isinstance(message, str):
        return message
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _registered(root: Path, ref: str):
    """(name, client, model version) of params' registered model at version or alias `ref`."""
    from tasks.runtime.params import load_params
    from tasks.registry.registry import resolve_version
    from tasks.registry.serving import registry_client

    name = load_params(root / "params.yaml").tracking.registered_model
    client = registry_client(root)
    return name, client, resolve_version(client, name, ref)


def _cmd_serve(args) -> int:
    import socket
    import threading

    from tasks.runtime.params import ParamsError
    from tasks.registry.serving import curl_example, serve_command, wait_until_serving

    root = Path(args.root).resolve()
    try:
        name, _, mv = _registered(root, args.alias)
    except (ParamsError, KeyError) as exc:
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2
    with socket.socket() as sock:
        try:
            sock.bind((args.host, args.port))
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port", file=sys.stderr)
            return 2
    cmd, env = serve_command(root, name, args.alias, args.host, args.port, args.workers)
    tasks = (mv.tags.get("crucible.tasks") or "TASK").split(",")
    print(f"serving {name} version {mv.version} (@{args.alias}) at http://{args.host}:{args.port}/invocations "
          f"(tasks: {', '.join(tasks)}); Ctrl-C stops it.")
    print("try:")
    print(f"  {curl_example(args.host, args.port, tasks[0])}")
    print(f"  # -> {{\"predictions\": [{{\"task\": \"{tasks[0]}\", \"label\": ..., \"proba_<class>\": ...}}]}}", flush=True)
    proc = subprocess.Popen(cmd, env=env)

    def announce() -> None:  # loading takes a while: say when it answers
        try:
            wait_until_serving(f"http://{args.host}:{args.port}", proc, 600)
        except RuntimeError:
            return  # the server's own output says why
        print(f"ready: http://{args.host}:{args.port}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 0


def _cmd_predict(args) -> int:
    from mlflow.exceptions import MlflowException

    import pandas as pd

    from tasks.runtime.params import ParamsError
    from tasks.registry.serving import load_registered

    root = Path(args.root).resolve()
    try:
        name, _, mv = _registered(root, args.alias)
        known = [t for t in (mv.tags.get("crucible.tasks") or "").split(",") if t]
        if known and args.task not in known:
            raise KeyError(f"unknown task {args.task!r}; valid tasks: {', '.join(known)}")
        model, _ = load_registered(root, mv.version, name)
        out = model.predict(pd.DataFrame({"text": args.texts, "task": [args.task] * len(args.texts)}))
    except (ParamsError, KeyError, MlflowException) as exc:
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2
    cols = [c for c in out.columns if c.startswith("proba_") and out[c].notna().all()]
    if args.json:
        print(json.dumps([{"text": t, **{k: v for k, v in r.items() if k in ["task", "label", *cols]}}
                          for t, r in zip(args.texts, out.to_dict("records"))], indent=2))
        return 0
    print(f"{name} version {mv.version} (@{args.alias}), task {args.task}")
    for text, (_, row) in zip(args.texts, out.iterrows()):
        probs = "  ".join(f"{c[len('proba_'):]} {row[c]:.3f}" for c in cols)
        print(f"{row['label']:<12} {probs}   {text[:70]}{'...' if len(text) > 70 else ''}")
    return 0


def _cmd_lineage(args) -> int:
    from tasks.runtime import lineage
    from tasks.runtime.params import ParamsError
    from tasks.registry.serving import version_summary
    from tasks.runtime.tracking import git_commit

    root = Path(args.root).resolve()
    try:
        name, _, mv = _registered(root, args.ref)
        result = lineage.compare(root, mv.tags, git_commit(root))
    except (ParamsError, KeyError, ValueError) as exc:
        print(f"error: {_message(exc)}", file=sys.stderr)
        return 2
    print(lineage.report(result, version_summary(name, mv)))
    return 0 if result["matches"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crucible", description="A reproducible post-training pipeline.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run the pipeline as a Prefect flow (DVC state kept consistent)")
    p.add_argument("--profile", help="a profile (profiles/NAME.yaml or a path): run in a scratch copy of the project")
    p.add_argument("--workspace", help="where the profile's scratch copy lives (default build/PROFILE)")
    p.add_argument("--stage", action="append", help="run only this stage (repeatable)")
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("stage", help="run one stage (what dvc.yaml calls)")
    p.add_argument("stage")
    p.add_argument("--task", help="the task, for per-task stages")
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=_cmd_stage)

    p = sub.add_parser("dag", help="dvc.yaml from the stages' declarations: write, check, or show the DAG")
    p.add_argument("action", choices=["write", "check", "show"])
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=_cmd_dag)

    p = sub.add_parser("params", help="validate or render params")
    p.add_argument("action", choices=["check", "render"])
    p.add_argument("file", nargs="?", default="params.yaml")
    p.add_argument("--profile")
    p.add_argument("-o", "--output")
    p.set_defaults(func=_cmd_params)

    p = sub.add_parser("ui", help="start the MLflow UI and a Prefect server on 127.0.0.1")
    p.add_argument("--root", default=".")
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.set_defaults(func=_cmd_ui)

    p = sub.add_parser("deploy", help="serve prefect.yaml's scheduled deployments (starts a Prefect server on 127.0.0.1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4200, help="the Prefect server's port (default 4200)")
    p.add_argument("--timeout", type=float, default=180, help="seconds to wait for the server to start")
    p.add_argument("--root", default=".")
    p.set_defaults(func=_cmd_deploy)

    p = sub.add_parser("serve", help="serve the registered model over HTTP (mlflow models serve) on 127.0.0.1")
    p.add_argument("--alias", default="champion", help="alias or version number (default: champion)")
    p.add_argument("--port", type=int, default=5001)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=1, help="server processes, each with its own copy of the model")
    p.add_argument("--root", default=".")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("predict", help="classify texts with the registered model, in this process")
    p.add_argument("texts", nargs="+", metavar="TEXT")
    p.add_argument("--task", required=True, help="the task whose head answers")
    p.add_argument("--alias", default="champion", help="alias or version number (default: champion)")
    p.add_argument("--json", action="store_true", help="print JSON records")
    p.add_argument("--root", default=".")
    p.set_defaults(func=_cmd_predict)

    p = sub.add_parser("lineage", help="a registered version's lineage, checked against dvc.lock and the disk")
    p.add_argument("ref", metavar="VERSION|ALIAS")
    p.add_argument("--root", default=".")
    p.set_defaults(func=_cmd_lineage)
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    # SIGTERM (a scheduler's kill, `kill PID`) unwinds like Ctrl-C: the stage's MLflow run is marked
    # FAILED, its staged outputs are discarded, its scratch folder removed. (SIGKILL cannot be
    # caught: the next start marks such a run FAILED and sweeps its files.)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    apply_defaults(Path(getattr(args, "root", ".")))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
