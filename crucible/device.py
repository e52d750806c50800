"""Devices and precision: where a stage's torch work runs and in which number format.

    device = resolve_device("auto")                 # cuda:0 when a CUDA device is visible, else cpu
    dtype = autocast_dtype(device, "auto")          # bf16 on a GPU that supports it, else None (fp32)
    with autocast(device, dtype):
        logits = model(*to_device(batch, model_device(model)))

The rules every function in crucible that takes a model follows (docs/architecture.md, devices):
- inputs go to the model's device (`model_device`), never to a hard-coded one; results that leave
  the library (features, logits, statistics written to disk) come back to the CPU in float32;
- weights stay float32 (the master copy); bf16 is autocast around the forward pass only, so the
  optimizer, the merge arithmetic and the saved files keep float32;
- random draws that decide bytes (masks, batch order, head init) come from CPU generators, so a
  CPU and a GPU run draw the same numbers; dropout draws on the model's device.

On CUDA, `make_deterministic` turns on torch's deterministic algorithms (and the cuBLAS workspace
setting they need) and turns TF32 off: the same device and params then give the same bytes. The
CPU path is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

PRECISIONS = ("auto", "fp32", "bf16")
DEVICE_ENV = "CRUCIBLE_DEVICE"  # overrides runtime.device (a scheduler that assigns GPUs sets it)
PRECISION_ENV = "CRUCIBLE_PRECISION"  # overrides runtime.precision


class DeviceUnavailable(ValueError):
    """The device asked for is not visible to this process."""


def visible_cuda() -> int:
    """How many CUDA devices this process sees (0 without a CUDA build or driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver counts as none
        return 0


def resolve_device(spec: str = "auto", what: str = "device") -> torch.device:
    """`auto` | `cpu` | `cuda` | `cuda:N` -> a torch.device that exists here. `auto` is the first
    CUDA device when one is visible, else the CPU. A CUDA device that is not visible raises
    DeviceUnavailable naming `what` (the param or variable that asked) and what is visible."""
    spec = str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda", 0) if visible_cuda() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index = 0 if spec == "cuda" else spec.split(":", 1)[1]
        if not str(index).isdigit():
            raise ValueError(f"{what} = {spec!r}: expected auto, cpu, cuda or cuda:N")
        index, n = int(index), visible_cuda()
        if index >= n:
            seen = (
                "no CUDA device is visible"
                if n == 0
                else f"{n} CUDA device{'s are' if n > 1 else ' is'} visible (cuda:0..cuda:{n - 1})"
            )
            build = "" if torch.version.cuda else f"; this torch ({torch.__version__}) is a CPU build"
            raise DeviceUnavailable(f"{what} = {spec!r}, but {seen}{build}")
        return torch.device("cuda", index)
    raise ValueError(f"{what} = {spec!r}: expected auto, cpu, cuda or cuda:N")


def bf16_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        return bool(torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001
        return False


def autocast_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype of the forward passes, or None for plain float32.
    auto: bf16 on a CUDA device that supports it, fp32 elsewhere (a CPU run stays as it was);
    bf16: bf16 on any device (on a CPU it is slower than fp32; allowed for checking)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if bf16_supported(device) else None


def precision_name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """torch.autocast on `device` in `dtype`, or a no-op for None (float32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (or buffer); the CPU for a model with neither."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def to_device(value: Any, device: torch.device | str) -> Any:
    """A tensor, or the tensors inside a tuple / list / dict, moved to `device` (others unchanged)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_deterministic(device: torch.device) -> None:
    """On CUDA: deterministic algorithms where torch has them (an op without one warns instead of
    failing), the cuBLAS workspace setting they need, no TF32, no cuDNN autotuning. A no-op on the
    CPU, whose kernels are deterministic for a fixed thread count already."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def describe(device: torch.device) -> dict[str, str]:
    """What a run records about where it ran: device, torch and CUDA versions, the device's name."""
    out = {"device": str(device), "torch": torch.__version__, "cuda": str(torch.version.cuda or "none")}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    else:
        import platform

        out["device_name"] = platform.processor() or platform.machine()
    return out


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def from_environment(environ=None) -> tuple[torch.device, torch.dtype | None]:
    """(device, autocast dtype) from CRUCIBLE_DEVICE / CRUCIBLE_PRECISION, `auto` where unset: what
    a served or loaded model uses (the registered pyfunc runs with crucible's library alone)."""
    environ = os.environ if environ is None else environ
    device = resolve_device(environ.get(DEVICE_ENV) or "auto", what=DEVICE_ENV)
    return device, autocast_dtype(device, environ.get(PRECISION_ENV) or "auto")


def triton_build_errors() -> tuple[type[BaseException], ...]:
    """Triton's errors for a kernel that does not compile or does not fit the device; () without triton."""
    found = []
    for module, name in (("triton.compiler.errors", "CompilationError"), ("triton.runtime.errors", "OutOfResources")):
        try:
            found.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


# (what, device) -> why that kernel did not build there
UNBUILT: dict[tuple[str, str], str] = {}


def launched(what: str, device: torch.device | str, launch, instead: str) -> bool:
    """Run `launch()` (a Triton kernel launch) and say True; False, with one warning per `what` and
    device, where it does not build there (a compile or resource error: remembered, so it is not
    tried again), and the caller runs `instead`, the slower kernel that does."""
    key = (what, str(device))
    if key in UNBUILT:
        return False
    try:
        launch()
        return True
    except triton_build_errors() as exc:
        first = str(exc).strip().splitlines()[:1]
        UNBUILT[key] = f"{type(exc).__name__}: {first[0][:200] if first else ''}"
        warnings.warn(f"{what} did not build on {key[1]} ({UNBUILT[key]}); {instead} runs instead", RuntimeWarning, 3)
        return False
