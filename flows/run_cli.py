"""`crucible run`: checks before anything starts, the workspace's lock, then the Prefect flow under it
(flows/pipeline.py), each error as one line with the traceback in the run's log (flows/runlog.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flows.runlog import describe
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


def cmd_run(args) -> int:
    """`crucible run`: the workspace's lock, then the flow under it (exit 2: an error of the user's, 3: the workspace
    is busy)."""
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
