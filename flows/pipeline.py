"""The whole DAG as a Prefect flow: the same stage functions that `dvc repro` runs.

    crucible run                       # this flow on params.yaml, local, threads
    crucible run --profile tiny        # in a scratch copy of the project with the tiny profile

The flow follows the DAG that the stages' declarations give (tasks/runtime/declaration.py): a run
of a stage (per task where the stage is) starts as soon as the runs whose outputs it reads are
done, so embed@bbc does not wait for ingest@trec and the MoE branch runs beside the classifier
chain; runs go to the task runner that params choose (threads here; Dask or Ray clusters through
prefect-dask / prefect-ray). Before a run the flow asks DVC whether it is up to date and skips it
if so; after it the flow records it with `dvc commit`, so that afterwards `dvc status` is clean
and `dvc repro` does nothing. One MLflow parent run per flow run; each stage run logs a child run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from flows import dvc
from flows.resources import GpuSlots, local_cluster_gpus, local_gpus, requesting, spreads_locally
from tasks.runtime import quiet, tracking
from tasks.runtime.declaration import instances, overlaps, upstream
from tasks.runtime.lock import WorkspaceLock
from tasks.runtime.params import load_params
from tasks.runtime.params_schema import Params
from tasks.stages import NAMES, execute, module, spec


class StageFailed(RuntimeError):
    """A stage run failed (its exception is the cause); `others`: further runs that failed."""

    def __init__(self, sid: str, others: list[str] | None = None):
        super().__init__(f"stage {sid} failed")
        self.sid, self.others = sid, list(others or ())


@task(name="stage", task_run_name="{sid}", retries=0)
def run_stage(
    stage: str,
    task_name: str | None,
    root: str,
    parent_run_id: str,
    share: int,
    lock_token: str | None = None,
    sid: str = "",
    device: str | None = None,
) -> dict:
    """One stage run on whatever worker the task runner picked. `share`: how many stage runs go
    side by side; each takes cores // share torch threads of the machine it runs on (not of the
    flow's). `share` 0: a switched-off stage, which leaves the threads alone. `device`: the GPU
    the flow assigned this run (flows/resources.py), or None (the runtime section decides)."""
    threads = max(1, (os.cpu_count() or 1) // share) if share else None
    return execute(
        stage, task_name, root, parent_run_id=parent_run_id, threads=threads, lock_token=lock_token, device=device
    ).to_dict()


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
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": p.max_workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
                "silence_logs": logging.WARNING,
                **local_cluster_gpus(params),
            }
        )
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise ImportError(f"pipeline.runner = 'ray' needs prefect-ray: {EXTRA_HINT.format('ray')}") from None
    address = os.environ.get("CRUCIBLE_RAY_ADDRESS") or p.address
    if address:
        return RayTaskRunner(address=address)
    return RayTaskRunner(
        init_kwargs={
            "num_cpus": p.max_workers,
            "include_dashboard": False,
            "log_to_driver": False,
            **local_cluster_gpus(params),
        }
    )


@flow(name="crucible-pipeline")
def pipeline(root: str = ".", stages: list[str] | None = None, lock_token: str | None = None) -> dict:
    """Run the pipeline in project `root` (optionally only the listed stages). Returns, per stage
    id, 'skipped' or the stage's result (paths, hashes, metrics). `lock_token`: the token of the
    workspace lock that the caller (`crucible run`) already holds; without it the flow takes the lock."""
    quiet.install()  # a deployment's flow run starts in a process of Prefect's, not through `crucible`
    logger = get_run_logger()
    root_path = Path(root).resolve()
    params = load_params(root_path / "params.yaml")
    use_dvc = dvc.is_dvc_project(root_path)
    if not use_dvc:
        logger.warning("%s is not a DVC project (no .dvc/ or dvc.yaml): stages run, nothing is recorded", root_path)
    for stage in NAMES:
        module(stage)  # import in this thread: module imports are not all thread-safe

    def tell(message: str) -> None:  # on stderr as `crucible stage` says it, and in the flow run's log
        tracking.say(message)
        logger.warning(message)

    lock = WorkspaceLock(
        root_path,
        "flow",
        params.pipeline.lock_timeout,
        token=lock_token,
        require_dvc_idle=use_dvc,
        on_wait=tell,
        on_stale=tell,
    )
    with lock:
        return _run(root_path, params, stages, use_dvc, lock.token, logger)


def _run(root_path: Path, params: Params, stages: list[str] | None, use_dvc: bool, token: str, logger) -> dict:
    unknown = sorted(set(stages or ()) - set(NAMES))
    if unknown:
        raise KeyError(f"unknown stages {unknown}; valid: {', '.join(NAMES)}")
    wait = params.pipeline.lock_timeout
    tasks = list(params.pipeline.tasks)
    specs = [spec(n) for n in NAMES]
    if stages and "model" not in stages:  # every stage that loads the model reads its manifest: hash it first
        stages = ["model", *stages]
    runs = {s.sid(t): (s.name, t) for s, t in instances(specs, tasks) if not stages or s.name in stages}
    # a run waits for the selected runs whose outputs it reads (an unselected one counts as done)
    edges = upstream(specs, tasks)
    waits = {sid: ups & set(runs) for sid, ups in edges.items() if sid in runs}
    # The cores a run gets follow from the DAG, not from what happens to run beside it, so its
    # outputs (whose sums round by thread count) are the same bytes on every run: a run shares the
    # cores with every run that may go beside it (at most max_workers); a switched-off stage (the
    # MoE branch under moe.enabled: false) writes a note, takes no cores and is not counted.
    off = {s.sid(t) for s, t in instances(specs, tasks) if s.switch and not _switched_on(params, s.switch)}
    width = overlaps({sid: ups - off for sid, ups in edges.items() if sid not in off})
    shares = {sid: 0 if sid in off else min(params.pipeline.max_workers, width[sid]) for sid in runs}
    parent = tracking.start_parent_run(
        root_path,
        params.tracking.experiment,
        "pipeline",
        {"crucible.kind": "pipeline", "crucible.tasks": ",".join(tasks)},
    )
    results: dict[str, object] = {}
    running: dict = {}  # future -> stage id
    slots = GpuSlots(local_gpus(params) if spreads_locally(params) else [])
    assigned: dict[str, str | None] = {}  # stage id -> the GPU the flow gave it
    finished: set[str] = set()
    failed: dict[str, BaseException] = {}
    try:
        while waits or running:
            # runs whose upstream failed never start; the others' results are still recorded
            blocked = set(failed)
            while stuck := [s for s, ups in waits.items() if ups & blocked]:
                for sid in stuck:
                    waits.pop(sid)
                    blocked.add(sid)
                    results[sid] = "not run"
                    logger.error("%s not run: an upstream run failed", sid)
            ready = [sid for sid, ups in waits.items() if ups <= finished]
            if ready:
                todo = dvc.stale(root_path, ready, wait=wait) if use_dvc else set(ready)
                # the model stage always runs: it hashes the base model's files, which DVC cannot see
                # (a packaged model lies outside the workspace); the same files write the same bytes,
                # so what depends on its manifest stays up to date
                todo |= {sid for sid in ready if sid == "model"}
                for sid in ready:
                    waits.pop(sid)
                    if sid not in todo:
                        logger.info("%s is up to date: skipped", sid)
                        results[sid] = "skipped"
                        finished.add(sid)
                for sid in [sid for sid in ready if sid in todo]:
                    name, task_name = runs[sid]
                    assigned[sid] = slots.take()
                    with requesting(params):  # a cluster's GPUs per run (runtime.gpus_per_task)
                        running[
                            run_stage.submit(
                                name,
                                task_name,
                                str(root_path),
                                parent,
                                shares[sid],
                                token,
                                sid=sid,
                                device=assigned[sid],
                            )
                        ] = sid
                continue
            if not running:
                break
            done = _first_done(list(running))
            batch = [f for f in running if f is done or f.state.is_final()]
            ok = []
            for fut in batch:
                sid = running.pop(fut)
                slots.give(assigned.pop(sid, None))
                try:
                    results[sid] = fut.result()
                    ok.append(sid)
                    logger.info("%s done", sid)
                except Exception as exc:  # let the other runs finish and be recorded
                    logger.error("%s failed: %s", sid, exc)
                    failed[sid] = exc
            if use_dvc and ok:
                dvc.commit(root_path, ok, wait=wait)
            finished.update(ok)
        if failed:
            (sid, exc), *others = failed.items()
            raise StageFailed(sid, [o for o, _ in others]) from exc
    except BaseException:
        tracking.end_run(root_path, parent, "FAILED")
        raise
    tracking.end_run(root_path, parent, "FINISHED")
    return {sid: results[sid] for sid in runs if sid in results}


def _switched_on(params: Params, key: str) -> bool:
    value = params
    for part in key.split("."):
        value = getattr(value, part)
    return bool(value)


def _first_done(futures: list):
    """The first of `futures` to finish (whatever the task runner)."""
    from prefect.futures import as_completed

    return next(iter(as_completed(futures)))


def run_pipeline(root: Path | str = ".", stages: list[str] | None = None, lock_token: str | None = None) -> dict:
    """The flow with the task runner that the project's params choose (`lock_token`: see pipeline).
    Without PREFECT_API_URL Prefect starts a temporary API server; it dies with this process, even
    a SIGKILLed one (flows/children.py)."""
    from flows.children import guard_prefect_server

    guard_prefect_server()
    params = load_params(Path(root) / "params.yaml")
    flow_run = pipeline.with_options(task_runner=task_runner(params))
    return flow_run(root=str(root), stages=stages, lock_token=lock_token)


def summary_table(results: dict, seconds: float, root: Path, params: Params) -> str:
    """The per-stage summary of a finished run (`crucible run`, and each run of `crucible deploy`):
    what ran and for how long, what was up to date, then the smoke-test notice and evaluate's
    warnings."""
    lines = [f"\npipeline finished in {seconds:.1f} s ({root})"]
    for sid, res in results.items():
        status = "up to date" if res == "skipped" else f"ran in {res['seconds']:.1f} s"
        lines.append(f"  {sid:<28} {status}")
    return "\n".join(lines + _run_notes(Path(root), params))


def _run_notes(root: Path, params) -> list[str]:
    """What a finished run's summary adds: the smoke-test notice, evaluate's warnings."""
    notes = []
    if params.pipeline.smoke_test:
        notes.append(
            "note: a smoke test (pipeline.smoke_test, e.g. the tiny profile): it shows every stage runs; its "
            "models see a few steps of small samples and are not meant for use"
        )
    try:
        notes += [
            f"warning: {w}" for w in json.loads((root / "metrics" / "evaluate.json").read_text()).get("warnings", [])
        ]
    except (OSError, ValueError):
        pass
    return notes


@flow(name="crucible-scheduled")
def scheduled(root: str = ".", stages: list[str] | None = None) -> dict:
    """Deployment entry point (prefect.yaml, `crucible deploy`): the pipeline on the task runner
    params choose (optionally only the listed stages), then the same per-stage summary as
    `crucible run`, on stdout and in the flow run's log."""
    import time

    start = time.perf_counter()
    results = run_pipeline(root, stages)
    text = summary_table(
        results, time.perf_counter() - start, Path(root).resolve(), load_params(Path(root) / "params.yaml")
    )
    print(text, flush=True)
    get_run_logger().info("%s", text)
    return results
