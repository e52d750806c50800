"""The `crucible` command.

    crucible run [--profile tiny] [--stage ingest ...]   the pipeline as a Prefect flow
    crucible stage ingest --task bbc                     one stage (what dvc.yaml runs)
    crucible params check [FILE] [--profile tiny]        validate params
    crucible params render [--profile tiny] [-o FILE]    params with a profile applied
    crucible ui                                          MLflow UI + Prefect server on 127.0.0.1
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks.env import apply_defaults


def _cmd_params(args) -> int:
    from tasks.params import ParamsError, load_params, render_params

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
    from tasks.params import ParamsError
    from tasks.stage import execute

    try:
        result = execute(args.stage, args.task, args.root)
    except (ParamsError, FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
        print(f"error: stage {args.stage}{'@' + args.task if args.task else ''}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2, default=str))
    return 0


def _cmd_run(args) -> int:
    from tasks.params import ParamsError, load_params

    root = Path(args.root).resolve()
    try:
        if args.profile:
            from tasks.workspace import make_workspace

            root = make_workspace(root, args.workspace or root / "build" / Path(args.profile).stem, args.profile)
            apply_defaults(root)
            print(f"profile {args.profile}: running in {root}")
        load_params(root / "params.yaml")
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from flows.pipeline import run_pipeline

    start = time.perf_counter()
    results = run_pipeline(root, args.stage or None)
    print(f"\npipeline finished in {time.perf_counter() - start:.1f} s ({root})")
    for sid, res in results.items():
        status = "up to date" if res == "skipped" else f"ran in {res['seconds']:.1f} s"
        print(f"  {sid:<28} {status}")
    return 0


def _cmd_ui(args) -> int:
    from tasks.tracking import tracking_uri

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
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    apply_defaults(Path(getattr(args, "root", ".")))
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
