"""GPUs for the flow's stage runs.

On one machine (the threads runner, or a local Dask cluster) the flow itself spreads its stage runs
over the visible GPUs: each run it submits gets the GPU with the fewest runs on it (`GpuSlots`),
passed to the stage as its device, so two per-task fine-tunes on a two-GPU machine use one GPU
each. That happens only where `runtime.device` (or CRUCIBLE_DEVICE) is `auto` or `cuda`; a pinned
`cuda:N` or `cpu` is what every run gets.

On a cluster the scheduler places the runs: each run asks for `runtime.gpus_per_task` GPUs,
- Ray: `num_gpus` of the task (prefect-ray's remote_options); Ray then sets CUDA_VISIBLE_DEVICES
  for the worker process, so `auto` is the GPU Ray gave it;
- Dask: the worker resource `GPU` (dask.annotate); start each worker with `--resources GPU=1`
  and its own CUDA_VISIBLE_DEVICES (one worker per GPU), as dask-cuda's LocalCUDACluster does.
"""

from __future__ import annotations

import contextlib
import os

from crucible.device import DEVICE_ENV, visible_cuda


def local_gpus(params, environ=None) -> list[int]:
    """The CUDA devices the flow spreads runs over on this machine: all visible ones when the device
    is `auto` or `cuda`; none (every run resolves its device itself) otherwise."""
    environ = os.environ if environ is None else environ
    spec = (environ.get(DEVICE_ENV) or params.runtime.device).strip().lower()
    if spec not in ("auto", "cuda"):
        return []
    return list(range(visible_cuda()))


class GpuSlots:
    """Which GPU the next run gets: the one with the fewest runs on it now (the lowest index on a
    tie). `take` returns a device string (None without GPUs); `give` hands it back."""

    def __init__(self, gpus: list[int]):
        self.load = {g: 0 for g in gpus}

    def take(self) -> str | None:
        if not self.load:
            return None
        gpu = min(self.load, key=lambda g: (self.load[g], g))
        self.load[gpu] += 1
        return f"cuda:{gpu}"

    def give(self, device: str | None) -> None:
        if device is not None:
            self.load[int(device.split(":")[1])] -= 1


def spreads_locally(params) -> bool:
    """The flow assigns GPUs itself: threads, or a local Dask cluster (its workers see every GPU).
    Ray (local or not) and a remote Dask cluster assign them."""
    runner, address = params.pipeline.runner, _address(params)
    return runner == "threads" or (runner == "dask" and not address)


def _address(params) -> str | None:
    env = {"dask": "CRUCIBLE_DASK_ADDRESS", "ray": "CRUCIBLE_RAY_ADDRESS"}.get(params.pipeline.runner)
    return (os.environ.get(env) if env else None) or params.pipeline.address


def gpu_request(params) -> dict:
    """What one stage run asks the task runner's scheduler for: {} or {"num_gpus": g} (Ray) or
    {"resources": {"GPU": g}} (Dask)."""
    g = params.runtime.gpus_per_task
    if not g:
        return {}
    if params.pipeline.runner == "ray":
        return {"num_gpus": g}
    if params.pipeline.runner == "dask":
        return {"resources": {"GPU": g}}
    return {}


@contextlib.contextmanager
def requesting(params):
    """Submit the block's stage runs with `gpu_request(params)`: prefect-ray's remote_options, or
    dask.annotate (which prefect-dask passes on to the scheduler)."""
    request = gpu_request(params)
    if not request:
        yield request
    elif params.pipeline.runner == "ray":
        from prefect_ray.context import remote_options

        with remote_options(**request):
            yield request
    else:
        import dask

        with dask.annotate(**request):
            yield request


def local_cluster_gpus(params) -> dict:
    """Extra arguments of a local cluster the flow starts: Ray's num_gpus (the visible GPUs), a
    Dask worker's resources (so annotated runs can be placed at all)."""
    g = params.runtime.gpus_per_task
    if params.pipeline.runner == "ray":
        return {"num_gpus": visible_cuda()} if visible_cuda() else {}
    if params.pipeline.runner == "dask" and g:
        return {"resources": {"GPU": max(g, visible_cuda() // max(1, params.pipeline.max_workers))}}
    return {}
