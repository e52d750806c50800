"""The training loop the MoE's recovery (crucible.moe.recover) and replay QAT (crucible.moe.qat) share:
train only the given parameters, resume from the latest checkpoint written with the same settings,
take an optimizer step, and checkpoint (safetensors plus JSON, no pickle: crucible.checkpoint)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from crucible.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["train_only", "resume", "optimizer_step"]


@contextmanager
def train_only(params: dict[str, nn.Parameter], *models: nn.Module):
    """Within the block: only `params` require gradients and every model is in eval mode (dropout off);
    after it, every parameter's requires_grad and every model's mode are as they were."""
    flags = {p: p.requires_grad for m in models for p in m.parameters()}
    modes = [m.training for m in models]
    try:
        for p in flags:
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        for m in models:
            m.eval()
        yield
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
        for m, mode in zip(models, modes):
            m.train(mode)


def resume(
    checkpoint_dir: Path | str | None,
    settings: dict,
    steps: int,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    key: str,
) -> tuple[int, list[dict]]:
    """(step, history) to continue from: those of the latest checkpoint in `checkpoint_dir`, its
    parameters (under `key`) and optimizer state loaded; (0, []) without one. ValueError when the
    checkpoint was written with other settings or is past `steps`."""
    latest = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    if latest is None:
        return 0, []
    ckpt = load_checkpoint(latest)
    if ckpt["settings"] != settings:
        diff = {k: (ckpt["settings"].get(k), v) for k, v in settings.items() if ckpt["settings"].get(k) != v}
        raise ValueError(f"{latest}: the checkpoint was written with other settings (checkpoint, this run): {diff}")
    if int(ckpt["step"]) > steps:
        raise ValueError(
            f"{latest}: the checkpoint is at step {int(ckpt['step'])}, past steps={steps}; "
            f"pass steps >= {int(ckpt['step'])} or another checkpoint_dir"
        )
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(ckpt[key][k])
    optimizer.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"]), list(ckpt["history"])


def optimizer_step(
    value: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    params: dict[str, nn.Parameter],
    *,
    step: int,
    batch: int,
    history: list[dict],
    steps: int,
    settings: dict,
    key: str,
    name: str,
    checkpoint_dir: Path | str | None = None,
    checkpoint_every: int = 0,
    max_grad_norm: float | None = None,
    bar=None,
    log: Callable[[dict, int], None] | None = None,
) -> int:
    """One step on the loss `value`: backward, optional clipping, the optimizer's step; the step's
    record appended to `history`, the progress bar moved, a checkpoint written every
    `checkpoint_every` steps and at the last, `log` called. Returns the new step count. A loss that
    is not finite stops the loop `name` before anything is updated (a ValueError naming the step)."""
    if not torch.isfinite(value):
        raise ValueError(f"{name}: the loss is {float(value)} at step {step + 1} (batch {batch})")
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
    optimizer.step()
    step += 1
    history.append({"step": step, "loss": float(value.detach()), "batch": batch})
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['loss']:.4g}")
    if checkpoint_dir is not None and ((checkpoint_every and step % checkpoint_every == 0) or step == steps):
        state = {
            "step": step,
            "settings": settings,
            "history": history,
            "optimizer": optimizer.state_dict(),
            key: {k: p.detach() for k, p in params.items()},
        }
        save_checkpoint(checkpoint_dir, step, state)
    if log is not None:
        log(dict(history[-1]), step)
    return step
