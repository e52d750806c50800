"""One evaluation pass of a MoE variant against the float MoE (docs/methods.md, moe).

    ref = float_reference(moe_float, eval_ids, batch_size=8)     # perplexity, routes, hidden states
    metrics = evaluate_variant(model, eval_ids, ref)              # a quantized variant against it
    metrics = reference_metrics(moe_float, ref)                   # the float MoE's own row

Every variant is evaluated in one forward pass over eval_ids (batches of `batch_size`, no replay:
the model routes by itself; "float" is the reference pass itself): perplexity (exactly
crucible.moe.lm.perplexity's definition); its own routes against the float MoE's on the same
tokens (routing.consistency: per layer set and top-1 agreement); the hidden-state drift per decoder
layer against the float MoE (routing.hidden_drift's definition: ||h_l - h_float,l|| / ||h_float,l||
over all eval tokens); its token agreement (the share of eval positions whose argmax next token
equals the float MoE's); its size (mx_storage.moe_nbytes: bytes, bits per weight).

metrics of one variant (JSON-serialisable; quantize_variants' metrics["variants"][name]):
    {perplexity, token_agreement, consistency: {layer: {set, top1}}, consistency_mean: {set, top1},
     drift: {"layers.<l>": d}, drift_mean, drift_last, load: {layer: [E shares of the eval tokens
     under the variant's own routing]}, bytes: moe_nbytes(model) (without bits_per_weight),
     bits_per_weight: moe_nbytes(model)["bits_per_weight"]["model"], bits_per_weight_detail}

calibration_fit(model, float_model, batches) scores a candidate on the calibration batches (never the
eval ids): the mean over predicted tokens of KL(p_float || p_model) of the next-token distributions
(replay QAT's "kl" loss at temperature 1, but each model routing by itself, as at inference) and
the model's own perplexity there; quantize_variants picks the start of replay QAT by that KL.

The checks of eval_ids and of integer arguments are shared with crucible.moe.variants (whose
quantize_variants calls these for every variant); their messages name quantize_variants.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass

import torch
from torch import nn

from crucible.hooks import forward_hooks
from crucible.moe.mx_storage import moe_nbytes
from crucible.moe.routing import Routes, consistency, expert_load, forward_batch, record_routes

__all__ = [
    "FloatReference",
    "float_reference",
    "evaluate_variant",
    "reference_metrics",
    "calibration_fit",
    "float_log_probs",
]


def _check_int(value, name: str, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < low
        or (high is not None and value > high)
    ):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"quantize_variants: {name} must be an int {span}, got {value!r}")
    return int(value)


def _check_ids(ids, name: str, vocab: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(
            f"quantize_variants: {name} must be an integer tensor [N, T], got "
            f"{type(ids).__name__} {getattr(ids, 'dtype', '')} {list(getattr(ids, 'shape', []))}"
        )
    if ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"quantize_variants: {name} shape {list(ids.shape)} needs N >= 1 rows of T >= 2 tokens")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(
            f"quantize_variants: {name} holds ids in [{int(ids.min())}, {int(ids.max())}], outside the "
            f"vocabulary [0, {vocab})"
        )
    return ids.long()


# --------------------------------------------------------------------------- one evaluation pass


@dataclass
class FloatReference:
    """The float MoE on the eval sequences: perplexity, routes (no replay) and hidden states per batch."""

    perplexity: float
    routes: Routes
    hidden: list[tuple[torch.Tensor, ...]]  # per eval batch: output_hidden_states[1:] (float32)
    predictions: list[torch.Tensor]  # per eval batch: argmax next-token ids [B, T - 1]
    eval_shape: tuple[int, int]
    batch_size: int
    seconds: float = 0.0


def _rows(ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [ids[s : s + batch_size] for s in range(0, ids.shape[0], batch_size)]


@torch.no_grad()
def _eval_pass(
    model: nn.Module,
    eval_ids: torch.Tensor,
    batch_size: int,
    reference: FloatReference | None,
    keep_hidden: bool,
    progress: bool,
    desc: str,
):
    """One forward per batch of eval_ids: perplexity, routes, hidden drift vs reference (if given),
    and the hidden states themselves (if keep_hidden)."""
    batches = [
        {"input_ids": b, "attention_mask": torch.ones_like(b), "output_hidden_states": True, "use_cache": False}
        for b in _rows(eval_ids, batch_size)
    ]
    acc = {"nll": 0.0, "count": 0, "i": 0, "diff": None, "ref": None, "agree": 0}
    kept: list[tuple[torch.Tensor, ...]] = []
    preds: list[torch.Tensor] = []

    def hook(module, args, kwargs, output):
        ids = kwargs["input_ids"]
        logp = torch.log_softmax(output.logits[:, :-1].float(), dim=-1)
        token_nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        if not bool(torch.isfinite(token_nll).all()):
            raise ValueError(f"quantize_variants: {desc}: the log-probabilities of the eval targets are not finite")
        acc["nll"] += float(token_nll.double().sum())
        acc["count"] += token_nll.numel()
        pred = logp.argmax(-1)
        hs = tuple(h.detach().float() for h in output.hidden_states[1:])
        if keep_hidden:
            kept.append(tuple(h.clone() for h in hs))
            preds.append(pred)
        if reference is not None:
            acc["agree"] += int((pred == reference.predictions[acc["i"]]).sum())
            ref = reference.hidden[acc["i"]]
            if len(ref) != len(hs):
                raise ValueError(f"quantize_variants: {desc} has {len(hs)} layers, the float reference {len(ref)}")
            d = [float((x.double() - y.double()).pow(2).sum()) for x, y in zip(hs, ref)]
            e = [float(y.double().pow(2).sum()) for y in ref]
            acc["diff"] = d if acc["diff"] is None else [p + q for p, q in zip(acc["diff"], d)]
            acc["ref"] = e if acc["ref"] is None else [p + q for p, q in zip(acc["ref"], e)]
        acc["i"] += 1

    items = batches
    if progress:
        from crucible.progress import Progress

        items = Progress(batches, desc=f"eval {desc}", unit="batch")
    with forward_hooks([(model, hook)], with_kwargs=True):
        routes = record_routes(model, items)
    ppl = math.exp(acc["nll"] / acc["count"])
    drift = None
    if reference is not None:
        drift = {
            f"layers.{i}": math.sqrt(d / r) if r > 0 else float("nan")
            for i, (d, r) in enumerate(zip(acc["diff"], acc["ref"]))
        }
    return ppl, routes, drift, kept, preds, acc["agree"] / acc["count"]


def float_reference(
    moe_float: nn.Module, eval_ids: torch.Tensor, batch_size: int = 8, progress: bool = False
) -> FloatReference:
    """The float MoE's perplexity, routes and hidden states on eval_ids (for quantize_variants)."""
    eval_ids = _check_ids(eval_ids, "eval_ids", int(moe_float.config.vocab_size))
    _check_int(batch_size, "batch_size", 1)
    t0 = time.perf_counter()
    ppl, routes, _, hidden, preds, _ = _eval_pass(moe_float, eval_ids, batch_size, None, True, progress, "float")
    return FloatReference(ppl, routes, hidden, preds, tuple(eval_ids.shape), int(batch_size), time.perf_counter() - t0)


def _metrics(
    ppl: float, reference: FloatReference, routes: Routes, drift: dict, model: nn.Module, agreement: float
) -> dict:
    cons = {
        n: {"set": c["set_agreement"], "top1": c["top1_agreement"]}
        for n, c in consistency(reference.routes, routes).items()
    }
    size = moe_nbytes(model)
    d = list(drift.values())
    return {
        "perplexity": ppl,
        "token_agreement": agreement,
        "consistency": cons,
        "consistency_mean": {k: sum(c[k] for c in cons.values()) / len(cons) for k in ("set", "top1")},
        "drift": drift,
        "drift_mean": sum(d) / len(d),
        "drift_last": d[-1],
        "load": {n: [float(x) for x in row] for n, row in zip(routes.layers, expert_load(routes))},
        "bytes": {k: v for k, v in size.items() if k != "bits_per_weight"},
        "bits_per_weight": size["bits_per_weight"]["model"],
        "bits_per_weight_detail": size["bits_per_weight"],
    }


def reference_metrics(moe_float: nn.Module, reference: FloatReference) -> dict:
    """The float variant's metrics from its reference pass: its routes against themselves (consistency
    1), drift 0, its perplexity and size; `load` is the float MoE's expert load on the eval tokens."""
    n_layers = len(reference.hidden[0])
    return _metrics(
        reference.perplexity, reference, reference.routes, {f"layers.{i}": 0.0 for i in range(n_layers)}, moe_float, 1.0
    )


def evaluate_variant(
    model: nn.Module,
    eval_ids: torch.Tensor,
    reference: FloatReference,
    batch_size: int | None = None,
    progress: bool = False,
    name: str = "variant",
) -> dict:
    """The metrics of one model on eval_ids against the float reference (see the module docstring)."""
    batch_size = reference.batch_size if batch_size is None else batch_size
    if tuple(eval_ids.shape) != reference.eval_shape or batch_size != reference.batch_size:
        raise ValueError(
            f"evaluate_variant: eval_ids {list(eval_ids.shape)} in batches of {batch_size}, the reference "
            f"was taken on {list(reference.eval_shape)} in batches of {reference.batch_size}"
        )
    ppl, routes, drift, _, _, agree = _eval_pass(model, eval_ids, batch_size, reference, False, progress, name)
    return _metrics(ppl, reference, routes, drift, model, agree)


@torch.no_grad()
def float_log_probs(float_model: nn.Module, batches) -> list[torch.Tensor]:
    """Per batch, the float model's next-token log-probabilities [B, T - 1, V] (float32), for
    calibration_fit's `reference` (computed once when several candidates are scored)."""
    was_training = float_model.training
    float_model.eval()
    try:
        return [torch.log_softmax(forward_batch(float_model, b).logits[:, :-1].float(), dim=-1) for b in batches]
    finally:
        float_model.train(was_training)


@torch.no_grad()
def calibration_fit(model: nn.Module, float_model: nn.Module, batches, reference: list | None = None) -> dict:
    """{"kl", "perplexity"} of `model` on calibration `batches` (tensors of input ids [B, T]), each
    model routing by itself: kl = the mean over predicted positions of KL(p_float || p_model) of the
    next-token distributions (float32 log-softmax), perplexity = exp(mean -log p_model(next token)).
    `reference`: float_log_probs(float_model, batches), if already computed."""
    kl, nll, count = 0.0, 0.0, 0
    batches = list(batches)
    if reference is None:
        reference = float_log_probs(float_model, batches)
    if len(reference) != len(batches):
        raise ValueError(f"calibration_fit: {len(reference)} reference batches for {len(batches)} batches")
    was_training = model.training
    model.eval()
    try:
        for batch, ref in zip(batches, reference):
            logq = torch.log_softmax(forward_batch(model, batch).logits[:, :-1].float(), dim=-1)
            ids = batch[:, 1:].to(logq.device).unsqueeze(-1)
            kl += float((ref.exp() * (ref - logq)).sum(-1).double().sum())
            nll += float(-logq.gather(-1, ids).double().sum())
            count += ids.numel()
    finally:
        model.train(was_training)
    if not count or not (math.isfinite(kl) and math.isfinite(nll)):
        raise ValueError(f"calibration_fit: no calibration token or a non-finite score (kl {kl}, nll {nll})")
    return {"kl": kl / count, "perplexity": math.exp(nll / count)}
