"""A short recovery of a MoEfied model by distillation from its dense source (docs/methods.md, moe;
CMoE, Pei et al. 2025, recovers its training-free MoE with a short fine-tune).

    history = recover(moe, dense, batches, steps=60, lr=1e-3, train="router",
                      checkpoint_dir="ckpt", checkpoint_every=20)

Each step takes one batch (the batches in a seeded per-epoch order, crucible.moe.qat.batch_order),
runs the MoE with its own routing and minimises KL(p_dense || p_moe) of the next-token
distributions at `temperature` (times temperature^2), averaged over tokens (a dict batch's
attention_mask excludes padding). The dense model's log-probabilities are computed once per batch
and kept. What trains, cheapest first:
- train="router": every MoE block's router weight (`mlp.gate.weight`, which sets both the top-k
  choice and the combine weights, its scale included) and the shared expert's gate
  (`mlp.shared_expert_gate.weight`, the shared expert's per-token scale);
- train="experts": those and every expert's weights (routed `experts.*`, `shared_expert.*`);
- train="layers": every parameter of the decoder layers that hold the MoE blocks (attention and
  norms too), so attention can adapt to the sparser FFNs; embeddings, the final norm and lm_head stay.
What is not trained has requires_grad off for the run (restored afterwards). Both models run in
eval mode. AdamW without weight decay, constant lr.

Deterministic given `seed`. Resumable as replay QAT is: every `checkpoint_every` steps (and at the
last) the trained tensors, the AdamW state, the step and the history go to
checkpoint_dir/step-<7 digits>/ (safetensors + JSON, crucible.checkpoint); a later call with the same
checkpoint_dir continues from the newest one and ends where an uninterrupted run ends; the
settings it checks include a digest of the trained tensors at the start, so a checkpoint of another
model (an earlier build) is refused, never loaded into this one.

Contract
- recover(moe, dense, batches, steps, lr=1e-3, train="router", temperature=1.0, seed=0,
  checkpoint_dir=None, checkpoint_every=0, progress=True, log=None, cache_bytes=2**30) -> history, one
  {"step", "loss", "batch"} per step (including resumed steps). batches[i] is one forward call
  (crucible.moe.routing.forward_batch). ValueError, naming the argument and the value, for steps < 0,
  lr not finite > 0, an unknown `train`, temperature not finite > 0, no batches, a model without MoE
  blocks, a dense model of another vocabulary, a non-finite loss (naming the step), cache_bytes
  < 0, or a checkpoint written with other settings. steps=0 returns the (resumed) history unchanged.
- trainable_parameters(moe, train) -> {name: parameter} of what `train` trains.
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
from crucible.moe.qat import _mask, _masked_mean, batch_order
from crucible.moe.routing import forward_batch, moe_layers
from crucible.progress import Progress

__all__ = ["TRAIN", "recover", "trainable_parameters"]

TRAIN = ("router", "experts", "layers")


def trainable_parameters(moe: nn.Module, train: str = "router") -> dict[str, nn.Parameter]:
    """name -> parameter of what `train` trains (see the module docstring)."""
    if train not in TRAIN:
        raise ValueError(f"recover: train={train!r} must be one of {TRAIN}")
    blocks = moe_layers(moe)
    out = {}
    if train == "layers":  # the decoder layer holding each block: its parent module
        for name in blocks:
            parent = name.rsplit(".", 1)[0]
            for pname, p in moe.get_submodule(parent).named_parameters():
                out[f"{parent}.{pname}"] = p
        return out
    for name, block in blocks.items():
        out[f"{name}.gate.weight"] = block.gate.weight
        gate = getattr(block, "shared_expert_gate", None)
        if gate is not None:
            out[f"{name}.shared_expert_gate.weight"] = gate.weight
        if train == "experts":
            for sub in ("experts", "shared_expert"):
                module = getattr(block, sub, None)
                if module is not None:
                    for pname, p in module.named_parameters():
                        out[f"{name}.{sub}.{pname}"] = p
    return out


def _digest(params: dict[str, nn.Parameter]) -> str:
    """sha256 over the names and bytes of the tensors a run starts from: a checkpoint resumes only the
    model it was trained from (another build's checkpoint is refused, not silently loaded)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in params.items():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check(moe, dense, batches, steps, lr, temperature, checkpoint_every, cache_bytes) -> None:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"recover: steps={steps!r} must be an int >= 0")
    for name, value in (("lr", lr), ("temperature", temperature)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"recover: {name}={value!r} must be finite and > 0")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, numbers.Integral) or checkpoint_every < 0:
        raise ValueError(f"recover: checkpoint_every={checkpoint_every!r} must be an int >= 0")
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, numbers.Integral) or cache_bytes < 0:
        raise ValueError(f"recover: cache_bytes={cache_bytes!r} must be an int >= 0")
    if not batches:
        raise ValueError("recover: batches is empty; give at least one batch of calibration token ids")
    vocab_moe, vocab_dense = moe.config.vocab_size, dense.config.vocab_size
    if vocab_moe != vocab_dense:
        raise ValueError(
            f"recover: the dense model's vocab_size={vocab_dense} differs from the MoE's {vocab_moe}; "
            "distil from the model the MoE was built from"
        )


def recover(
    moe: nn.Module,
    dense: nn.Module,
    batches: Sequence,
    steps: int,
    lr: float = 1e-3,
    train: str = "router",
    temperature: float = 1.0,
    seed: int = 0,
    checkpoint_dir: Path | str | None = None,
    checkpoint_every: int = 0,
    progress: bool = True,
    log: Callable[[dict, int], None] | None = None,
    cache_bytes: int = 2**30,
) -> list[dict]:
    """Distil `dense` into `moe`'s routers (and, with train="experts", its experts) for `steps`
    AdamW steps in total; see the module docstring."""
    batches = list(batches)
    _check(moe, dense, batches, steps, lr, temperature, checkpoint_every, cache_bytes)
    params = trainable_parameters(moe, train)
    settings = {
        "lr": float(lr),
        "train": train,
        "temperature": float(temperature),
        "seed": int(seed),
        "batches": len(batches),
        "params": {k: list(p.shape) for k, p in params.items()},
        "start": _digest(params),
    }
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    step, history = resume(checkpoint_dir, settings, steps, params, optimizer, "params")
    targets: dict[int, torch.Tensor] = {}
    cached = 0  # bytes held in targets
    bar = Progress(
        total=steps, initial=min(step, steps), desc=f"moe recovery ({train})", unit="step", disable=not progress
    )
    try:
        with train_only(params, moe, dense):
            while step < steps:
                b = batch_order(step, len(batches), seed, True)
                batch, mask = batches[b], _mask(batches[b])
                mask = None if mask is None else mask.to(model_device(moe))
                target = targets.get(b)
                if target is None:
                    with torch.no_grad():
                        target = torch.log_softmax(forward_batch(dense, batch).logits.float() / temperature, dim=-1)
                    size = target.numel() * target.element_size()
                    if cached + size <= cache_bytes:
                        targets[b], cached = target, cached + size
                logq = torch.log_softmax(forward_batch(moe, batch).logits.float() / temperature, dim=-1)
                per_token = F.kl_div(logq, target.to(logq.device), log_target=True, reduction="none").sum(-1)
                value = _masked_mean(per_token, mask) * temperature**2
                step = optimizer_step(
                    value,
                    optimizer,
                    params,
                    step=step,
                    batch=b,
                    history=history,
                    steps=steps,
                    settings=settings,
                    key="params",
                    name="recover",
                    checkpoint_dir=checkpoint_dir,
                    checkpoint_every=checkpoint_every,
                    bar=bar,
                    log=log,
                )
    finally:
        bar.close()
    return history
