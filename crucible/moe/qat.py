"""Limited routing replay QAT (docs/methods.md, moe): train only the low-rank adapters of a quantized
MoE to match the float model, with the float model's routes forced.

    routes = record_routes(float_model, batches)                 # crucible.moe.routing
    history = replay_qat(qmodel, float_model, batches, routes, steps=200, lr=1e-3,
                         checkpoint_dir="ckpt", checkpoint_every=50)

Each step takes one batch (batches in a seeded per-epoch order), runs the quantized model under
`replay(qmodel, routes.batch(b))` (the float model's top-k sets; the combine weights come from the
quantized model's own router logits, as in R3) and minimises
- loss "kl" (default): KL(p_float || p_quant) of the next-token distributions at `temperature`,
  times temperature^2, averaged over tokens (a dict batch's attention_mask excludes padding);
- loss "hidden": the mean over decoder layers of ||h - h_float||^2 / ||h_float||^2 (relative MSE of
  output_hidden_states, so every layer counts alike whatever its scale).
Only adapters train (AdamW, no weight decay by default): the experts' (`MXExperts.*_lora_*`) and,
with `train_attention`, those of the MXLinear layers of rank > 0. Everything else has
requires_grad off for the run (restored afterwards): the router, the packed MXFP4 weights and scales
(buffers), embeddings, norms, lm_head. Both models run in eval mode (no dropout, no router jitter).
The float model's targets are computed once per batch and cached (logits: tokens x vocab floats).

Deterministic given `seed`: the batch order is a pure function of (seed, epoch) and nothing else
is random. Resumable: every `checkpoint_every` steps (and at the last) the adapters, the AdamW state,
the step and the history are written to checkpoint_dir/step-<7 digits>/ as safetensors + JSON (no
pickle, crucible.checkpoint.save_checkpoint); a later call with the same checkpoint_dir continues from the
newest one and ends with the same adapters as an uninterrupted run. At the end the adapters are
rounded to their storage dtype (mx_experts.round_adapters), so save_quantized_moe writes what the model
computes.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from crucible.device import model_device
from crucible.moe.loop import optimizer_step, resume, train_only
from crucible.moe.mx_experts import MXExperts, round_adapters
from crucible.moe.routing import Routes, check_routes, forward_batch, moe_layers, replay
from crucible.progress import Progress
from crucible.quant.linear import MXLinear
from crucible.seeding import epoch_seed, torch_generator

__all__ = ["LOSSES", "replay_qat", "adapter_parameters", "batch_order"]

LOSSES = ("kl", "hidden")


def adapter_parameters(qmodel: nn.Module, train_attention: bool = False) -> dict[str, nn.Parameter]:
    """name -> the adapter parameters replay QAT trains: every non-empty MXExperts adapter and, with
    `train_attention`, the adapters of MXLinear layers of rank > 0."""
    out = {}
    for name, m in qmodel.named_modules():
        if isinstance(m, MXExperts) or (train_attention and isinstance(m, MXLinear) and m.rank):
            for pname, p in m.named_parameters(recurse=False):
                if "lora_" in pname and p.numel():
                    out[f"{name}.{pname}"] = p
    return out


def batch_order(step: int, n: int, seed: int, shuffle: bool = True) -> int:
    """The batch index of optimizer step `step` (0-based): epoch step // n walks a permutation seeded
    with (seed, epoch). A pure function, so a resumed run needs only the step."""
    epoch, i = divmod(step, n)
    if not shuffle:
        return i
    g = torch_generator(epoch_seed(int(seed), epoch))
    return int(torch.randperm(n, generator=g)[i])


def _mask(batch) -> torch.Tensor | None:
    if isinstance(batch, dict) and batch.get("attention_mask") is not None:
        return batch["attention_mask"].bool()
    return None


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return per_token.mean()
    return per_token[mask].mean()


def _check(steps, lr, loss, temperature, checkpoint_every, batches, routes: Routes, qmodel):
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (isinstance(lr, numbers.Real) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, numbers.Integral) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be an int >= 0 (0 = only at the end), got {checkpoint_every!r}")
    if not batches:
        raise ValueError("replay_qat: no batch given")
    if len(routes.batch_tokens) != len(batches):
        raise ValueError(
            f"replay_qat: the routes were recorded over {len(routes.batch_tokens)} forward calls, "
            f"but {len(batches)} batches are given (record_routes(float_model, batches))"
        )
    check_routes(moe_layers(qmodel), routes, "replay_qat")


def replay_qat(
    qmodel: nn.Module,
    float_model: nn.Module,
    batches: Sequence,
    routes: Routes,
    steps: int,
    lr: float = 1e-3,
    loss: str = "kl",
    temperature: float = 1.0,
    checkpoint_dir: Path | str | None = None,
    checkpoint_every: int = 0,
    progress: bool = True,
    seed: int = 0,
    train_attention: bool = False,
    weight_decay: float = 0.0,
    shuffle: bool = True,
    max_grad_norm: float | None = None,
    log: Callable[[dict, int], None] | None = None,
) -> list[dict]:
    """Train `qmodel`'s adapters for `steps` optimizer steps in total (see the module docstring).

    batches[i] is one forward call (routing.forward_batch) and routes its float routes, recorded over
    the same batches in the same order. Returns the history, one {"step", "loss", "batch"} per step
    (including the steps of earlier, resumed runs). `log(metrics, step)` is called after each step.
    ValueError for bad arguments, routes that do not fit, no adapter to train (compensate_moe first:
    an adapter of rank 0 has nothing to train), or a checkpoint written with other settings."""
    batches = list(batches)
    _check(steps, lr, loss, temperature, checkpoint_every, batches, routes, qmodel)
    params = adapter_parameters(qmodel, train_attention)
    if not params:
        raise ValueError(
            "replay_qat: the quantized model has no adapter of rank > 0 to train; set ranks with "
            "compensate_moe first" + ("" if train_attention else " (attention adapters need train_attention=True)")
        )
    settings = {
        "lr": float(lr),
        "loss": loss,
        "temperature": float(temperature),
        "seed": int(seed),
        "train_attention": bool(train_attention),
        "weight_decay": float(weight_decay),
        "shuffle": bool(shuffle),
        "max_grad_norm": None if max_grad_norm is None else float(max_grad_norm),
        "batches": len(batches),
        "adapters": {k: list(p.shape) for k, p in params.items()},
    }
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=weight_decay)
    step, history = resume(checkpoint_dir, settings, steps, params, optimizer, "adapters")
    targets: dict[int, object] = {}
    bar = Progress(total=steps, initial=min(step, steps), desc="replay-qat", unit="step", disable=not progress)
    try:
        with train_only(params, qmodel, float_model):
            while step < steps:
                b = batch_order(step, len(batches), seed, shuffle)
                batch, mask = batches[b], _mask(batches[b])
                mask = None if mask is None else mask.to(model_device(qmodel))
                if b not in targets:
                    with torch.no_grad():
                        out = forward_batch(float_model, batch, output_hidden_states=loss == "hidden")
                        targets[b] = (
                            torch.log_softmax(out.logits.float() / temperature, dim=-1)
                            if loss == "kl"
                            else tuple(h.detach() for h in out.hidden_states[1:])
                        )
                with replay(qmodel, routes.batch(b)):
                    out = forward_batch(qmodel, batch, output_hidden_states=loss == "hidden")
                if loss == "kl":
                    logq = torch.log_softmax(out.logits.float() / temperature, dim=-1)
                    per_token = F.kl_div(logq, targets[b], log_target=True, reduction="none").sum(-1)
                    value = _masked_mean(per_token, mask) * temperature**2
                else:
                    terms = [
                        _masked_mean((h.float() - r.float()).pow(2).sum(-1), mask)
                        / _masked_mean(r.float().pow(2).sum(-1), mask)
                        for h, r in zip(out.hidden_states[1:], targets[b])
                    ]
                    value = torch.stack(terms).mean()
                step = optimizer_step(
                    value,
                    optimizer,
                    params,
                    step=step,
                    batch=b,
                    history=history,
                    steps=steps,
                    settings=settings,
                    key="adapters",
                    name="replay_qat",
                    checkpoint_dir=checkpoint_dir,
                    checkpoint_every=checkpoint_every,
                    max_grad_norm=max_grad_norm,
                    bar=bar,
                    log=log,
                )
    finally:
        bar.close()
    round_adapters(qmodel)
    return history
