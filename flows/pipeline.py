"""The whole DAG as a Prefect flow: the same stage functions that `dvc repro` runs.

    crucible run                       # this flow on params.yaml, local, threads
    crucible run --profile tiny        # in a scratch copy of the project with the tiny profile

Stages run in DAG order; a per-task stage fans out over the tasks on the task runner that
params choose (threads here; Dask or Ray clusters through prefect-dask / prefect-ray). Before each
stage the flow asks DVC whether it is up to date and skips it if so; after it the flow records it
with `dvc commit`, so that afterwards `dvc status` is clean and `dvc repro` does nothing.
One MLflow parent run per flow run; each stage (per task) logs a child run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from flows import dvc
from tasks.runtime import tracking
from tasks.runtime.lock import WorkspaceLock
from tasks.runtime.params import Params, load_params
from tasks.runtime.stage import PER_TASK, STAGES, execute, stage_id, stage_module


@task(name="stage", task_run_name="{stage}@{task_name}", retries=0)
def run_stage(stage: str, task_name: str | None, root: str, parent_run_id: str, share: int,
              lock_token: str | None = None) -> dict:
    """One stage on whatever worker the task runner picked. `share`: how many stages run side by
    side; each takes cores // share torch threads of the machine it runs on (not of the flow's)."""
    threads = max(1, (os.cpu_count() or 1) // share)
    return execute(stage, task_name, root, parent_run_id=parent_run_id, threads=threads,
                   lock_token=lock_token).to_dict()


EXTRA_HINT = "pip install -e '.[{0}]' (or: pip install prefect-{0})"


def task_runner(params: Params):
    """The Prefect task runner params ask for. Dask and Ray come from their Prefect integrations:
    a local cluster of `max_workers` single-threaded workers, or the cluster at `address`
    (CRUCIBLE_DASK_ADDRESS / CRUCIBLE_RAY_ADDRESS override params)."""
    p = params.pipeline
    if p.runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=p.max_workers)
    if p.runner == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise ImportError(f"pipeline.runner = 'dask' needs prefect-dask: {EXTRA_HINT.format('dask')}") from None
        address = os.environ.get("CRUCIBLE_DASK_ADDRESS") or p.address
        if address:
            return DaskTaskRunner(address=address)
        # processes, one thread each: a stage sets its own torch threads (cores // max_workers)
        return DaskTaskRunner(cluster_kwargs={"n_workers": p.max_workers, "threads_per_worker": 1,
                                              "processes": True, "dashboard_address": None,
                                              "silence_logs": logging.WARNING})
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise ImportError(f"pipeline.runner = 'ray' needs prefect-ray: {EXTRA_HINT.format('ray')}") from None
    address = os.environ.get("CRUCIBLE_RAY_ADDRESS") or p.address
    if address:
        return RayTaskRunner(address=address)
    return RayTaskRunner(init_kwargs={"num_cpus": p.max_workers, "include_dashboard": False,
                                      "log_to_driver": False})


@flow(name="crucible-pipeline")
def pipeline(root: str = ".", stages: list[str] | None = None) -> dict:
    """Run the pipeline in project `root` (optionally only the listed stages). Returns, per stage
    id, 'skipped' or the stage's result (paths, hashes, metrics)."""
    logger = get_run_logger()
    root_path = Path(root).resolve()
    params = load_params(root_path / "params.yaml")
    use_dvc = dvc.is_dvc_project(root_path)
    if not use_dvc:
        logger.warning("%s is not a DVC project (no .dvc/ or dvc.yaml): stages run, nothing is recorded", root_path)
    for stage in stages or STAGES:
        stage_module(stage)  # import in this thread: module imports are not all thread-safe
    lock = WorkspaceLock(root_path, "flow", params.pipeline.lock_timeout, require_dvc_idle=use_dvc,
                         on_wait=logger.warning, on_stale=logger.warning)
    with lock:
        return _run(root_path, params, stages, use_dvc, lock.token, logger)


def _run(root_path: Path, params: Params, stages: list[str] | None, use_dvc: bool, token: str, logger) -> dict:
    wait = params.pipeline.lock_timeout
    parent = tracking.start_parent_run(root_path, params.tracking.experiment, "pipeline",
                                       {"crucible.kind": "pipeline", "crucible.tasks": ",".join(params.pipeline.tasks)})
    results: dict[str, object] = {}
    try:
        for stage in stages or list(STAGES):
            sids = {stage_id(stage, t): t for t in (params.pipeline.tasks if stage in PER_TASK else [None])}
            todo = dvc.stale(root_path, list(sids), wait=wait) if use_dvc else set(sids)
            for sid in sids:
                if sid not in todo:
                    logger.info("%s is up to date: skipped", sid)
                    results[sid] = "skipped"
            # per-task stages run side by side and share the cores; a stage over all tasks runs alone
            # and gets them all (so merge and quantize are not left on one thread)
            share = min(params.pipeline.max_workers, len(todo)) if stage in PER_TASK else 1
            futures = {sid: run_stage.submit(stage, sids[sid], str(root_path), parent, max(1, share), token)
                       for sid in sids if sid in todo}
            done, failure = [], None
            for sid, fut in futures.items():
                try:
                    results[sid] = fut.result()
                    done.append(sid)
                    logger.info("%s done", sid)
                except Exception as exc:  # let the other tasks of this stage finish and be recorded
                    logger.error("%s failed: %s", sid, exc)
                    failure = failure or exc
            if use_dvc:
                dvc.commit(root_path, done, wait=wait)
            if failure is not None:
                raise failure
    except BaseException:
        tracking.end_run(root_path, parent, "FAILED")
        raise
    tracking.end_run(root_path, parent, "FINISHED")
    return results


def run_pipeline(root: Path | str = ".", stages: list[str] | None = None) -> dict:
    """The flow with the task runner that the project's params choose."""
    params = load_params(Path(root) / "params.yaml")
    return pipeline.with_options(task_runner=task_runner(params))(root=str(root), stages=stages)


@flow(name="crucible-scheduled")
def scheduled(root: str = ".", stages: list[str] | None = None) -> dict:
    """Deployment entry point (prefect.yaml, `crucible deploy`): the pipeline on the task runner
    params choose (optionally only the listed stages)."""
    return run_pipeline(root, stages)
