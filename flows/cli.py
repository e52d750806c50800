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
import time
from pathlib import Path

from flows.registry_cli import cmd_lineage, cmd_predict
from flows.servers import cmd_deploy, cmd_serve, cmd_ui
from tasks.runtime import quiet
from tasks.runtime.env import apply_defaults


def preflight(params, root: Path) -> None:
    """What can be checked before a run starts: the demo-only params set under source: files (a
    warning: they are ignored) and, under source: files, every task's input files (raises)."""
    from tasks.runtime.params_schema import demo_only_settings
    from tasks.stages.ingest import check_user_files

    for setting in demo_only_settings(params):
        print(f"warning: {setting} is a demo-only param; ingest.source is 'files', so it is ignored", file=sys.stderr)
    if params.ingest.source == "files":
        for task, n in check_user_files(params, root).items():
            counts = ", ".join(f"{k} {v}" for k, v in n.items() if k != "short_texts")
            print(
                f"  {params.ingest.files_dir}/{task}: OK ({counts} rows"
                + (f"; {n['short_texts']} texts under ingest.min_chars" if n["short_texts"] else "")
                + ")"
            )


def check_added_tasks(params, source: Path, profile: str | None) -> None:
    """A profile that names its tasks without `!override` adds them to the tasks it inherits: under
    source: files, when an inherited task has no input folder, say that (raises ParamsError), not
    which folder of a task the user never named is missing."""
    from tasks.runtime.params import ParamsError, profile_path, tasks_added

    found = tasks_added(source / "params.yaml", profile) if profile else None
    if found is None or params.ingest.source != "files":
        return
    where, own, inherited = found
    folder = source / params.ingest.files_dir
    missing = [t for t in inherited if not (folder / t).is_dir()]
    if missing:
        raise ParamsError(
            f"{profile_path(profile)}: pipeline.tasks adds {', '.join(own)} to the tasks of {where} "
            f"({', '.join(inherited)}) instead of replacing them, and {folder} has no folder for "
            f"{', '.join(missing)}; to run only the profile's tasks, write `tasks: !override` under pipeline "
            "in the profile (as profiles/files.yaml does)"
        )


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


def describe(exc: BaseException) -> str:
    """An error as one line: the message, without KeyError's quotes; an OSError that Python raised
    (no message of ours) as `<path>: <reason>`; MLflow's errors by their message."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, OSError) and type(exc).__str__ is OSError.__str__ and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}" + (f" ({exc.filename2})" if exc.filename2 else "")
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else str(exc)


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


def _cmd_run(args) -> int:
    from tasks.runtime.lock import WorkspaceLock, WorkspaceLocked
    from tasks.runtime.params import ParamsError, load_params
    from tasks.runtime.tracking import say

    source = Path(args.root).resolve()
    root = Path(args.workspace or source / "build" / Path(args.profile).stem).resolve() if args.profile else source
    try:  # the lock's timeout: the params this run will have (the profile's, rendered, nothing written)
        params = load_params(source / "params.yaml", args.profile)
        check_added_tasks(params, source, args.profile)  # before a scratch workspace is made for it
        timeout = params.pipeline.lock_timeout
    except (ParamsError, OSError, ValueError) as exc:
        print(f"error: {describe(exc)}", file=sys.stderr)
        return 2
    # the workspace is held before anything in it is written (its params.yaml, code and dvc.yaml),
    # so a run that waits changes nothing of the run it waits for; the flow runs under this lock
    lock = WorkspaceLock(root, "flow", timeout, require_dvc_idle=(root / ".dvc").is_dir(), on_wait=say, on_stale=say)
    try:
        lock.acquire()
    except WorkspaceLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    try:
        return _run_locked(args, source, root, lock.token)
    finally:
        lock.release()


def _run_locked(args, source: Path, root: Path, token: str) -> int:
    """`crucible run` once it holds the workspace `root` (a profile's scratch copy of `source`)."""
    from tasks.runtime.params import ParamsError, load_params

    try:
        if args.profile:
            from tasks.runtime.workspace import make_workspace

            make_workspace(source, root, args.profile)
            apply_defaults(root)
            print(f"profile {args.profile}: running in {root}")
        params = load_params(root / "params.yaml")
        from tasks.runtime.device import resolve

        runtime = resolve(params.runtime)  # a device that is not there: say so before the flow starts
        preflight(params, root)  # your input files, before any stage runs
        from tasks.stages import write_dvc_yaml

        if (root / "dvc.yaml").is_file() and write_dvc_yaml(root):  # it follows pipeline.tasks
            print(f"dvc.yaml: rewritten for pipeline.tasks ({', '.join(params.pipeline.tasks)})")
    except (ParamsError, OSError, ValueError) as exc:
        print(f"error: {describe(exc)}", file=sys.stderr)
        return 2
    print(f"runtime: {runtime.device} ({runtime.precision})")
    from flows.pipeline import StageFailed, run_pipeline, summary_table
    from flows.runlog import RunLog
    from tasks.runtime.lock import WorkspaceLocked
    from tasks.runtime.tracking import TrackingStoreError, check_store

    start = time.perf_counter()
    with RunLog(root) as runlog:
        try:
            check_store(root)  # an unreachable server or a corrupt mlflow.db: say so before the flow starts
            results = run_pipeline(root, args.stage or None, lock_token=token)
        except WorkspaceLocked as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 3
        except TrackingStoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except StageFailed as exc:
            runlog.record(exc.__cause__ or exc)
            print(f"error: stage {exc.sid}: {describe(exc.__cause__ or exc)}", file=sys.stderr)
            for sid in exc.others:
                print(f"error: stage {sid} failed too (see the log)", file=sys.stderr)
            print(f"the traceback and the run's full log: {runlog.path}", file=sys.stderr)
            return 2
        except Exception as exc:  # anything else: one line too, the traceback in the log
            runlog.record(exc)
            print(f"error: {type(exc).__name__}: {describe(exc)}", file=sys.stderr)
            print(f"the traceback and the run's full log: {runlog.path}", file=sys.stderr)
            return 1
    print(summary_table(results, time.perf_counter() - start, root, params))
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
