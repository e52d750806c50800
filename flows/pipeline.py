"""The whole DAG as a Prefect flow: the same stage functions that `dvc repro` runs.

    crucible run                       # this flow on params.yaml, local, threads
    crucible run --profile tiny        # in a scratch copy of the project with the tiny profile
    python -m flows.pipeline           # the same as `crucible run`

Stages run in DAG order; a per-task stage fans out over the tasks on the task runner that
params choose (threads here; Dask or Ray clusters through prefect-dask / prefect-ray). Before each
stage the flow asks DVC whether it is up to date and skips it if so; after it the flow records it
with `dvc commit`, so that afterwards `dvc status` is clean and `dvc repro` does nothing.
One MLflow parent run per flow run; each stage (per task) logs a child run.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from flows import dvc
from tasks import tracking
from tasks.params import Params, load_params
from tasks.stage import PER_TASK, STAGES, execute, stage_id, stage_module


@task(name="stage", task_run_name="{stage}@{task_name}", retries=0)
def run_stage(stage: str, task_name: str | None, root: str, parent_run_id: str, threads: int) -> dict:
    return execute(stage, task_name, root, parent_run_id=parent_run_id, threads=threads).to_dict()


def task_runner(params: Params):
    """The Prefect task runner params ask for. Dask and Ray come from their Prefect integrations."""
    p = params.pipeline
    if p.runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=p.max_workers)
    if p.runner == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise ImportError("pipeline.runner = 'dask' needs prefect-dask: pip install prefect-dask") from None
        address = os.environ.get("CRUCIBLE_DASK_ADDRESS")
        return DaskTaskRunner(address=address) if address else DaskTaskRunner(
            cluster_kwargs={"n_workers": p.max_workers, "threads_per_worker": 1})
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise ImportError("pipeline.runner = 'ray' needs prefect-ray: pip install prefect-ray") from None
    return RayTaskRunner(address=os.environ.get("CRUCIBLE_RAY_ADDRESS"))


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
    parent = tracking.start_parent_run(root_path, params.tracking.experiment, "pipeline",
                                       {"crucible.kind": "pipeline", "crucible.tasks": ",".join(params.pipeline.tasks)})
    results: dict[str, object] = {}
    try:
        for stage in stages or list(STAGES):
            sids = {stage_id(stage, t): t for t in (params.pipeline.tasks if stage in PER_TASK else [None])}
            todo = dvc.stale(root_path, list(sids)) if use_dvc else set(sids)
            for sid in sids:
                if sid not in todo:
                    logger.info("%s is up to date: skipped", sid)
                    results[sid] = "skipped"
            # per-task stages run side by side and share the cores; a stage over all tasks runs alone
            # and gets them all (so merge and quantize are not left on one thread)
            cores = os.cpu_count() or 1
            threads = max(1, cores // params.pipeline.max_workers) if stage in PER_TASK else cores
            futures = {sid: run_stage.submit(stage, sids[sid], str(root_path), parent, threads)
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
                dvc.commit(root_path, done)
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
def scheduled(root: str = ".") -> dict:
    """Deployment entry point (prefect.yaml): the pipeline on the task runner params choose."""
    return run_pipeline(root)


if __name__ == "__main__":
    from tasks.cli import main

    main(["run"])
