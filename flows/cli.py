"""The `crucible` command.

crucible run [--profile tiny] [--stage ingest ...]   the pipeline as a Prefect flow
crucible stage ingest --task bbc                     one stage (what dvc.yaml runs)
crucible dag write|check|show                        dvc.yaml from the stages' declarations
crucible params check [FILE] [--profile tiny]        validate params
crucible params render [--profile tiny] [-o FILE]    params with a profile applied
crucible data check [--profile mine]                 your input files (source: files), checked up front
crucible compare [REV ...]                           the figures to compare, per revision / experiment
crucible data example [--dir inputs]                 two example tasks in that format (sport, reviews)
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
import sys
from pathlib import Path

from flows.registry_cli import cmd_lineage, cmd_predict
from flows.run_cli import check_added_tasks, cmd_run, preflight
from flows.runlog import describe
from flows.servers import cmd_deploy, cmd_serve, cmd_ui
from tasks.runtime import quiet
from tasks.runtime.env import apply_defaults


def _cmd_params(args) -> int:
    import yaml

    from tasks.runtime.params import ParamsError, load_params, render_params

    try:
        if args.action == "check":
            params = load_params(args.file, args.profile)
            print(
                f"{args.file}{' + profile ' + args.profile if args.profile else ''}: OK "
                f"({len(params.pipeline.tasks)} tasks: {', '.join(params.pipeline.tasks)})"
            )
            preflight(params, Path(args.file).resolve().parent)
        else:
            data = render_params(args.file, args.profile)
            load_params(args.file, args.profile)
            text = yaml.safe_dump(data, sort_keys=False)
            if args.output:
                Path(args.output).write_text(text)
            else:
                sys.stdout.write(text)
    except (ParamsError, OSError, ValueError) as exc:
        print(f"error: {describe(exc)}", file=sys.stderr)
        return 2
    return 0


def _cmd_data(args) -> int:
    """`crucible data check`: params, then every task's input files, as ingest will read them."""
    from tasks.runtime.params import ParamsError, load_params

    root = Path(args.root).resolve()
    if args.action == "example":
        from tasks.data.example_inputs import TASKS, write_example_inputs

        folder = Path(args.dir) if Path(args.dir).is_absolute() else root / args.dir
        written = write_example_inputs(folder)
        print(
            f"wrote {len(written)} files: {', '.join(f'{folder}/{t}/' for t in TASKS)} "
            f"(reference, pool, audit, test .parquet each)"
        )
        return 0
    try:
        params = load_params(root / "params.yaml", args.profile)
        check_added_tasks(params, root, args.profile)
        if params.ingest.source != "files":
            print(
                f"ingest.source is 'demo': the {len(params.pipeline.tasks)} tasks are built from packaged "
                f"corpora; nothing under {params.ingest.files_dir}/ is read"
            )
            return 0
        preflight(params, root)
    except (ParamsError, OSError, ValueError) as exc:
        print(f"error: {describe(exc)}", file=sys.stderr)
        return 2
    print(f"{len(params.pipeline.tasks)} tasks ready for ingest")
    return 0


def _cmd_stage(args) -> int:
    from mlflow.exceptions import MlflowException

    from tasks.runtime.lock import WorkspaceLocked
    from tasks.runtime.params import ParamsError
    from tasks.stages import execute

    try:
        _check_dvc_yaml(args.stage, Path(args.root))
        result = execute(args.stage, args.task, args.root)
    except WorkspaceLocked as exc:
        print(f"error: stage {args.stage}{'@' + args.task if args.task else ''}: {exc}", file=sys.stderr)
        return 3
    except (ParamsError, OSError, KeyError, ValueError, RuntimeError, MlflowException) as exc:
        # OSError: a file that cannot be read or written (FileNotFoundError, PermissionError, a full disk)
        print(f"error: stage {args.stage}{'@' + args.task if args.task else ''}: {describe(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2, default=str))
    return 0


def _cmd_compare(args) -> int:
    from flows.compare import table

    try:
        print(table(args.root, args.revs))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_dvc_yaml(stage: str, root: Path) -> None:
    """Under `dvc repro` (which sets DVC_STAGE), a stage over all tasks refuses a dvc.yaml written
    for other tasks than params.yaml's: DVC would not rerun it when a new task's files change."""
    import os

    from tasks.stages import project_dvc_yaml, spec

    s = spec(stage)
    if not os.environ.get("DVC_STAGE") or s.per_task or not any("{task}" in d for d in s.deps):
        return
    path = root / "dvc.yaml"
    if path.is_file() and path.read_text() != project_dvc_yaml(root):
        raise ValueError(
            f"{path.resolve()} does not list the files of params.yaml's pipeline.tasks (it was written "
            f"for other tasks, or by other code): run `crucible dag write`, then `dvc repro` again"
        )


def _cmd_dag(args) -> int:
    """dvc.yaml from the stages' declarations: write it, check it, or show the DAG of stage runs."""
    from tasks.runtime.declaration import upstream
    from tasks.runtime.params import ParamsError, load_params
    from tasks.stages import project_dvc_yaml, specs, write_dvc_yaml

    root = Path(args.root).resolve()
    path = root / "dvc.yaml"
    try:
        tasks = list(load_params(root / "params.yaml").pipeline.tasks)
        if args.action == "write":
            print(f"wrote {path}" if write_dvc_yaml(root) else f"{path} is up to date")
            return 0
        if args.action == "check":
            if not path.is_file() or path.read_text() != project_dvc_yaml(root):
                print(
                    f"error: {path} is stale: it differs from the stages' declarations (tasks/stages/*.py) for "
                    f"pipeline.tasks ({', '.join(tasks)}); run `crucible dag write`",
                    file=sys.stderr,
                )
                return 1
            print(f"{path} matches the stages' declarations")
            return 0
    except ParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sid, ups in upstream(specs(), tasks).items():
        print(f"{sid:<24} <- {', '.join(sorted(ups)) or '(nothing)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crucible", description="A reproducible post-training pipeline.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run the pipeline as a Prefect flow (DVC state kept consistent)")
    p.add_argument("--profile", help="a profile (profiles/NAME.yaml or a path): run in a scratch copy of the project")
    p.add_argument("--workspace", help="where the profile's scratch copy lives (default build/PROFILE)")
    p.add_argument("--stage", action="append", help="run only this stage (repeatable)")
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("stage", help="run one stage (what dvc.yaml calls)")
    p.add_argument("stage")
    p.add_argument("--task", help="the task, for per-task stages")
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=_cmd_stage)

    p = sub.add_parser("dag", help="dvc.yaml from the stages' declarations: write, check, or show the DAG")
    p.add_argument("action", choices=["write", "check", "show"])
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=_cmd_dag)

    p = sub.add_parser(
        "data",
        help="check your input files (ingest.source: files) as ingest will read them; "
        "`example` writes two example tasks in that format",
    )
    p.add_argument("action", choices=["check", "example"])
    p.add_argument("--dir", default="inputs", help="example: the folder to write the tasks into (default inputs)")
    p.add_argument("--profile")
    p.add_argument("--root", default=".", help="project folder (default: .)")
    p.set_defaults(func=_cmd_data)

    p = sub.add_parser("params", help="validate or render params")
    p.add_argument("action", choices=["check", "render"])
    p.add_argument("file", nargs="?", default="params.yaml")
    p.add_argument("--profile")
    p.add_argument("-o", "--output")
    p.set_defaults(func=_cmd_params)

    p = sub.add_parser(
        "compare",
        help="the figures to compare (accuracy per task, eps_hat, CC-MMD, size, bits per "
        "weight, gate) in the work tree, HEAD and HEAD's DVC experiments, or given revisions",
    )
    p.add_argument("revs", nargs="*", metavar="REV", help="git revisions or DVC experiment names")
    p.add_argument("--root", default=".")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("ui", help="start the MLflow UI and a Prefect server on 127.0.0.1")
    p.add_argument("--root", default=".")
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser(
        "deploy", help="serve prefect.yaml's scheduled deployments (starts a Prefect server on 127.0.0.1)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4200, help="the Prefect server's port (default 4200)")
    p.add_argument("--timeout", type=float, default=180, help="seconds to wait for the server to start")
    p.add_argument("--root", default=".")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser(
        "serve",
        help="serve the registered model over HTTP (MLflow's scoring app, request limits from params' serve "
        "section) on 127.0.0.1",
    )
    p.add_argument("--alias", default="champion", help="alias or version number (default: champion)")
    p.add_argument("--port", type=int, default=5001)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=1, help="server processes, each with its own copy of the model")
    p.add_argument("--root", default=".")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("predict", help="classify texts with the registered model, in this process")
    p.add_argument("texts", nargs="+", metavar="TEXT")
    p.add_argument("--task", required=True, help="the task whose head answers")
    p.add_argument("--alias", default="champion", help="alias or version number (default: champion)")
    p.add_argument("--json", action="store_true", help="print JSON records")
    p.add_argument("--root", default=".")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("lineage", help="a registered version's lineage, checked against dvc.lock and the disk")
    p.add_argument("ref", metavar="VERSION|ALIAS")
    p.add_argument("--root", default=".")
    p.set_defaults(func=cmd_lineage)
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    # SIGTERM (a scheduler's kill, `kill PID`) unwinds like Ctrl-C: the stage's MLflow run is marked
    # FAILED, its staged outputs are discarded, its scratch folder removed. (SIGKILL cannot be
    # caught: the next start marks such a run FAILED and sweeps its files.)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    apply_defaults(Path(getattr(args, "root", ".")))
    quiet.install()  # before torch, transformers or mlflow are imported
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
