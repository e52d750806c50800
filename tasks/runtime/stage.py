"""The stage contract (docs/architecture.md): one implementation per stage, run by DVC and by Prefect.

A stage module (tasks/stages/) exposes
    SPEC: StageSpec                           what it reads and writes, declared once
                                              (tasks/runtime/declaration.py)
    run(params, task, root, log) -> dict      does the work; returns its metrics
`execute()` wraps any of them: loads params through the typed loader, hands the stage a view of
the params that holds only what it declares, checks that every input an earlier stage wrote is still
what that stage wrote (tasks/runtime/lockcheck.py: dvc.lock, or the producer's record of its last
run; else the stage stops naming the file and the stage to rerun), opens the stage's MLflow run,
logs the declared params, tags it with its lineage (git commit, md5 of every input and output),
records its outputs' md5 for the stages that read them, and returns paths and hashes, never
tensors, so Prefect results stay small.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.runtime import device as runtime_device
from tasks.runtime import lockcheck, quiet, tracking
from tasks.runtime.declaration import inputs, output_dirs, outputs, params_keys
from tasks.runtime.io import md5_file
from tasks.runtime.lock import WorkspaceLock
from tasks.runtime.memory import PeakRSS
from tasks.runtime.params import load_params
from tasks.runtime.params_access import declared_values, declared_view
from tasks.runtime.params_schema import Params


@dataclass
class StageResult:
    stage: str
    task: str | None
    outputs: dict[str, str] = field(default_factory=dict)  # path -> md5
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def execute(
    module,
    task: str | None = None,
    root: Path | str = ".",
    params: Params | None = None,
    parent_run_id: str | None = None,
    threads: int | None = None,
    lock_token: str | None = None,
    device: str | None = None,
) -> StageResult:
    """Run one stage (a tasks/stages module, for one task) in project `root`. Raises whatever the
    stage raises; then no output has been replaced. The stage holds the workspace lock
    (tasks/runtime/lock.py) while it runs, or runs under its flow's lock when `lock_token` is the
    flow's."""
    quiet.install()  # where the stage runs: a Prefect thread, a Dask worker process, `crucible stage`
    spec = module.SPEC
    root = Path(root).resolve()
    params = params or load_params(root / "params.yaml")
    if spec.per_task:
        if task not in params.pipeline.tasks:
            raise KeyError(
                f"stage '{spec.name}' runs per task; task {task!r} is not in pipeline.tasks "
                f"({', '.join(params.pipeline.tasks)})"
            )
    elif task is not None:
        raise ValueError(f"stage '{spec.name}' is not per task; got task {task!r}")
    # the device and precision (runtime section, CRUCIBLE_DEVICE / CRUCIBLE_PRECISION), resolved
    # before the lock and the MLflow run: a device that is not there stops the stage, nothing written
    # (`device`: the flow's GPU assignment for this run, flows/resources.py)
    runtime = runtime_device.resolve(params.runtime, device=device)
    # torch/BLAS threads per worker: parallel per-task stages must not oversubscribe the cores
    # (`threads`: the flow's share of the cores for this stage; CRUCIBLE_THREADS, when set, wins)
    # BLAS too (numpy, scikit-learn): its sums also split by thread count, and Dask's worker
    # processes start with OMP/MKL/OPENBLAS_NUM_THREADS=1 where a thread or `dvc repro` has every core
    threads = int(os.environ["CRUCIBLE_THREADS"]) if os.environ.get("CRUCIBLE_THREADS") else threads
    if threads:
        import torch
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(threads)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)  # for BLAS/OpenMP libraries loaded later in the stage
        threadpool_limits(limits=threads)  # for those already loaded
    with WorkspaceLock(root, "stage", params.pipeline.lock_timeout, token=lock_token, on_wait=_say, on_stale=_say):
        return _execute(spec, task, root, params, module, parent_run_id, runtime)


_say = tracking.say  # `crucible: <message>` on stderr


def _execute(
    spec, task, root: Path, params: Params, module, parent_run_id, runtime: runtime_device.Runtime = runtime_device.CPU
) -> StageResult:
    # a killed earlier run's temporary files and scratch folders (never a live run's)
    from tasks.runtime.scratch import sweep

    sweep(root, output_dirs(spec, task))
    keys = params_keys(spec, task, params)
    # Every path is resolved against `root` explicitly: no chdir, which would race between
    # Prefect's worker threads.
    start = time.perf_counter()
    # the inputs, hashed once: each must be what its producer wrote (dvc.lock, or the producer's own
    # record of its last run) before the stage reads it; the same hashes are the lineage tags
    read = {p.as_posix(): md5_file(root / p) for p in inputs(spec, task, root, list(params.pipeline.tasks))}
    lockcheck.check(root, spec.sid(task), read)
    with tracking.stage_run(root, params.tracking.experiment, spec.name, task, parent_run_id) as log:
        log.log_params(declared_values(params, keys))
        log.set_tags({f"crucible.input.{p}": h for p, h in read.items()})
        log.set_tags(runtime.tags())
        with PeakRSS() as rss, runtime_device.using(runtime):
            metrics = module.run(declared_view(params, keys, spec.name), task, root, log)
        written = {str(p): md5_file(root / p) for p in outputs(spec, task, root)}
        lockcheck.record(root, spec.sid(task), written)
        log.set_tags({f"crucible.output.{p}": h for p, h in written.items()})
        seconds = time.perf_counter() - start
        log.log_metrics({**metrics, "stage_seconds": seconds, **rss.metrics()})
    return StageResult(spec.name, task, written, metrics, seconds)
