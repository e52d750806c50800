"""Argument checks of the MXFP4 Triton wrappers (crucible.quant.triton_kernels): each raises
ValueError naming the wrapper, the argument and what it got, before anything is launched."""

from __future__ import annotations

import os

import torch

from crucible.quant.mxfp4 import BLOCK


def _interpreting() -> bool:
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except Exception:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_tensor(name: str, t, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_k(k, where: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % BLOCK:
        raise ValueError(f"{where}: k must be a positive multiple of {BLOCK}, got {k!r}")
    return k


def _check_devices(where: str, **tensors) -> torch.device:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    dev = named[0][1].device
    for n, t in named[1:]:
        if t.device != dev:
            raise ValueError(
                f"{where}: {n} is on {t.device} but {named[0][0]} is on {dev}; all tensors must be on one device"
            )
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpreting()):
        raise ValueError(
            f"{where}: tensors on {dev} need a CUDA device, or TRITON_INTERPRET=1 (set "
            f"before triton is imported) for CPU tensors; use crucible.quant.mxfp4 otherwise"
        )
    return dev


def _check_packed(where: str, packed, scales, k: int, lead=None) -> tuple[int, ...]:
    _check_tensor("packed", packed, where)
    _check_tensor("scales", scales, where)
    if packed.dtype != torch.uint8:
        raise ValueError(f"{where}: packed must be torch.uint8, got {packed.dtype} (shape {_shape(packed)})")
    if scales.dtype != torch.uint8:
        raise ValueError(f"{where}: scales must be torch.uint8, got {scales.dtype} (shape {_shape(scales)})")
    if packed.dim() == 0 or packed.shape[-1] != k // 2:
        raise ValueError(f"{where}: packed must have last dimension k // 2 = {k // 2}, got shape {_shape(packed)}")
    plead = tuple(packed.shape[:-1])
    if lead is not None and plead != tuple(lead):
        raise ValueError(f"{where}: packed must have shape {[*lead, k // 2]}, got {_shape(packed)}")
    if tuple(scales.shape) != (*plead, k // BLOCK):
        raise ValueError(
            f"{where}: scales must have shape {[*plead, k // BLOCK]} (packed is "
            f"{_shape(packed)}, k = {k}), got {_shape(scales)}"
        )
    return plead


def _check_block(name: str, v, where: str, lo: int = 16) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
        why = "tl.dot's minimum" if lo == 16 else "one MX block of 32 per tile at least"
        raise ValueError(f"{where}: {name} must be a power of two >= {lo} ({why}), got {v!r}")
    return v
