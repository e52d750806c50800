"""The stage contract (ARCHITECTURE.md): one implementation per stage, run by DVC and by Prefect.

A stage module exposes
    inputs(params, task) -> list[Path]        files it reads (for lineage tags)
    outputs(params, task) -> list[Path]       files it writes (all atomically, together)
    run(params, task, root, log) -> dict      does the work; returns its metrics
`execute()` wraps any of them: loads params through the typed loader, opens the stage's MLflow run,
tags it with its lineage (git commit, md5 of every input and output, the params it used), and
returns paths and hashes, never tensors, so Prefect results stay small.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.runtime import tracking
from tasks.runtime.io import md5_file
from tasks.runtime.lock import WorkspaceLock
from tasks.runtime.params import Params, load_params

# stage name -> module; the order is the DAG's order
STAGES: dict[str, str] = {
    "ingest": "tasks.stages.ingest",
    "embed": "tasks.stages.embed",
    "curate": "tasks.stages.curate",
    "pseudolabel": "tasks.stages.pseudolabel",
    "finetune": "tasks.stages.finetune",
    "merge": "tasks.stages.merge",
    "quantize": "tasks.stages.quantize",
    "moe_build": "tasks.stages.moe_build",
    "moe_quantize": "tasks.stages.moe_quantize",
    "evaluate": "tasks.stages.evaluate",
    "register": "tasks.stages.register",
}
PER_TASK = {"ingest", "embed", "curate", "pseudolabel", "finetune"}


@dataclass
class StageResult:
    stage: str
    task: str | None
    outputs: dict[str, str] = field(default_factory=dict)  # path -> md5
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def stage_module(stage: str):
    if stage not in STAGES:
        raise KeyError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
    return importlib.import_module(STAGES[stage])


def stage_id(stage: str, task: str | None) -> str:
    """The DVC name of a stage: 'ingest@bbc' for a per-task stage."""
    return stage if task is None else f"{stage}@{task}"


def execute(stage: str, task: str | None = None, root: Path | str = ".", params: Params | None = None,
            parent_run_id: str | None = None, threads: int | None = None,
            lock_token: str | None = None) -> StageResult:
    """Run one stage (for one task) in project `root`. Raises whatever the stage raises; then no
    output has been replaced. The stage holds the workspace lock (tasks/runtime/lock.py) while it runs,
    or runs under its flow's lock when `lock_token` is the flow's."""
    root = Path(root).resolve()
    params = params or load_params(root / "params.yaml")
    module = stage_module(stage)
    if stage in PER_TASK:
        if task not in params.pipeline.tasks:
            raise KeyError(f"stage '{stage}' runs per task; task {task!r} is not in pipeline.tasks "
                           f"({', '.join(params.pipeline.tasks)})")
    elif task is not None:
        raise ValueError(f"stage '{stage}' is not per task; got task {task!r}")
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
    with WorkspaceLock(root, "stage", params.pipeline.lock_timeout, token=lock_token,
                       on_wait=_say, on_stale=_say):
        return _execute(stage, task, root, params, module, parent_run_id)


def _say(message: str) -> None:
    print(f"crucible: {message}", file=sys.stderr, flush=True)


def _execute(stage, task, root: Path, params: Params, module, parent_run_id) -> StageResult:
    # a killed earlier run's temporary files and scratch folders (never a live run's)
    from tasks.runtime.scratch import sweep

    sweep(root, {Path(p).parent for p in module.outputs(params, task)})
    # Every path is resolved against `root` explicitly: no chdir, which would race between
    # Prefect's worker threads.
    start = time.perf_counter()
    with tracking.stage_run(root, params.tracking.experiment, stage, task, parent_run_id) as log:
        section = getattr(params, stage, None)
        log.log_params({"seed": params.pipeline.seed, **({stage: section.model_dump()} if section is not None else {}),
                        **({"task": params.pipeline.tasks[task].model_dump()} if task else {})})
        log.set_tags({f"crucible.input.{_rel(p, root)}": md5_file(root / p)
                      for p in module.inputs(params, task) if (root / p).is_file()})
        metrics = module.run(params, task, root, log)
        listed = (module.outputs(params, task, root=root) if "root" in inspect.signature(module.outputs).parameters
                  else module.outputs(params, task))  # a stage whose outputs depend on what it wrote
        outputs = {str(p): md5_file(root / p) for p in listed}
        log.set_tags({f"crucible.output.{p}": h for p, h in outputs.items()})
        seconds = time.perf_counter() - start
        log.log_metrics({**metrics, "stage_seconds": seconds})
    return StageResult(stage, task, outputs, metrics, seconds)


def _rel(p: Path, root: Path) -> str:
    p = Path(p)
    return str(p.relative_to(root)) if p.is_absolute() else str(p)
