"""The run's device and precision (params.yaml `runtime`), resolved once per stage run.

`runtime.device` (auto | cpu | cuda | cuda:N) and `runtime.precision` (auto | fp32 | bf16) say
where a stage's torch work runs; CRUCIBLE_DEVICE and CRUCIBLE_PRECISION override them (a scheduler
that hands each worker its GPU sets CRUCIBLE_DEVICE, or CUDA_VISIBLE_DEVICES with `auto`). They are
not DVC dependencies and no stage declares them: moving a workspace onto a GPU does not rerun it.
What a run used is recorded instead, on its MLflow run (crucible.runtime.* tags) and in the config
its model outputs carry (`runtime_config`).

`execute()` (tasks/runtime/stage.py) resolves the runtime before the stage takes the workspace
lock or opens its MLflow run, so a device that is not there stops the stage with nothing written,
and runs the stage under `using(runtime)`; stage code reads it with `current()`. The runtime is
per thread: the flow's threads may run stages on different GPUs.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from crucible import device as devices

DEVICE_ENV, PRECISION_ENV = devices.DEVICE_ENV, devices.PRECISION_ENV


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    precision: str  # fp32 | bf16: what the forward passes run in
    source: str = "runtime.device"  # which setting chose the device (for messages)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def autocast(self):
        """bf16 autocast on the run's device, or nothing (fp32)."""
        return devices.autocast(self.device, self.autocast_dtype)

    def describe(self) -> dict[str, str]:
        return {**devices.describe(self.device), "precision": self.precision}

    def tags(self) -> dict[str, str]:
        """The MLflow tags of a stage run: crucible.runtime.{device,precision,torch,cuda,device_name}."""
        return {f"crucible.runtime.{k}": v for k, v in self.describe().items()}


CPU = Runtime(torch.device("cpu"), "fp32", "default")


def resolve(runtime_params=None, environ=None, device: str | None = None) -> Runtime:
    """The Runtime of `runtime_params` (the params' `runtime` section; None: auto/auto), with the
    environment's overrides; `device`, when given, is the flow's GPU assignment for this run and
    wins over both. Raises ValueError (DeviceUnavailable for a CUDA device not visible) naming the
    setting that asked."""
    environ = os.environ if environ is None else environ
    device_spec = getattr(runtime_params, "device", "auto")
    precision = getattr(runtime_params, "precision", "auto")
    device_source, precision_source = "runtime.device", "runtime.precision"
    if environ.get(DEVICE_ENV):
        device_spec, device_source = environ[DEVICE_ENV], DEVICE_ENV
    if device:
        device_spec, device_source = device, "the flow's GPU assignment"
    if environ.get(PRECISION_ENV):
        precision, precision_source = environ[PRECISION_ENV], PRECISION_ENV
    device = devices.resolve_device(device_spec, what=device_source)
    if precision not in devices.PRECISIONS:
        raise ValueError(f"{precision_source} = {precision!r}: expected one of {', '.join(devices.PRECISIONS)}")
    dtype = devices.autocast_dtype(device, precision)
    return Runtime(device, devices.precision_name(dtype), device_source)


_LOCAL = threading.local()


def current() -> Runtime:
    """The runtime of the stage running in this thread (the CPU in fp32 outside a stage)."""
    return getattr(_LOCAL, "runtime", None) or CPU


@contextmanager
def using(runtime: Runtime) -> Iterator[Runtime]:
    """Run a block with `runtime` as this thread's current one; on CUDA, deterministic algorithms
    on and that device made the default for the block's allocations."""
    previous = getattr(_LOCAL, "runtime", None)
    _LOCAL.runtime = runtime
    devices.make_deterministic(runtime.device)
    try:
        if runtime.device.type == "cuda":
            with torch.cuda.device(runtime.device):
                yield runtime
        else:
            yield runtime
    finally:
        _LOCAL.runtime = previous


def runtime_config() -> dict[str, str]:
    """The "runtime" entry of an output's config.json: the kind of device (cpu | cuda, not which
    one nor its name, so the bytes do not depend on the machine's slot), the precision, and the
    torch and CUDA versions."""
    runtime = current()
    return {
        "device": runtime.device.type,
        "precision": runtime.precision,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda or "none"),
    }
