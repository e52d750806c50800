"""The MoE quantization comparison in one function (docs/methods.md, moe; issue: MoE quantization):
float MoE, MXFP4, MXFP4 + uniform compensation, MXFP4 + load-aware compensation at the same total
rank, and limited routing replay QAT, each scored on held-out token sequences.

    ref = float_reference(moe, eval_ids)                          # optional (crucible.moe.variant_eval)
    out = quantize_variants(moe, calib_ids, eval_ids, rank_budget=default_rank_budget(moe),
                            qat_steps=24, qat_lr=1e-3, seed=0, dense=dense, reference=ref)
    out.metrics["variants"]["load_aware"]["perplexity"]; out.model   # the load-aware + QAT model

Steps (each timed in metrics["seconds"]):
1. float reference on eval_ids (once; `reference` reuses one): the float MoE's perplexity, its top-k
   routes and its hidden states (output_hidden_states, kept in RAM for the drift);
2. record the float MoE's routes on the calibration batches (calib_ids cut into rows of
   `batch_size`); expert_stats under those routes (routed inputs, loads; attention inputs);
3. moe_plan: the quantization error of every expert matrix (and attention q/k/v/o if `attention`)
   factorized once (qera scaling), shared by both allocations;
4. quantize a deep copy of the float MoE (quantize_moe: experts and, with `attention`, q/k/v/o in
   MXFP4; router, embeddings, norms, lm_head float): variant "mxfp4";
5. uniform ranks and load-aware ranks at the same total `rank_budget` (asserted equal), each set
   from the plan's truncated SVDs (compensate_moe): variants "uniform" and "load_aware";
6. replay QAT (crucible.moe.qat.replay_qat) starting from the load-aware compensated model: frozen
   router and MXFP4 codes, the float MoE's calibration routes replayed, only the expert adapters train
   toward the float MoE's next-token distributions on the calibration batches: variant "qat". With
   `qat_uniform` the same training also starts from the uniform model: variant "uniform_qat".
Every variant is evaluated by crucible.moe.variant_eval.evaluate_variant against the float
reference ("float" is the reference pass itself); "dense" (perplexity only) when `dense` is given.

At most three models are alive at once (the float MoE, the quantized base, one compensated copy;
with `qat_uniform` the uniform copy is kept for its QAT, so the float MoE and two quantized ones);
the plan (float64 SVDs) is dropped before QAT. Deterministic given `seed` (torch.manual_seed; the QAT
batch order is seeded; nothing else draws random numbers); only metrics["seconds"] varies between runs.

metrics (JSON-serialisable):
    variants: {name: evaluate_variant's metrics (crucible.moe.variant_eval)}   ("dense": perplexity, bytes)
    ranks: {budget, total: {uniform, load_aware}, experts_share: {uniform, load_aware} (the share of the
            budget on expert matrices), weighted_error: {uniform, load_aware} (the load-weighted
            discarded energy load-aware minimises), matrices: [{name, module, kind, expert, load,
            uniform, load_aware}]}                           # kind gate_up | down | q | k | v | o
    load_calib: {layer: [E shares of the calibration tokens (float routes), each row summing to top_k]}
    qat: {start, steps, lr, loss, batches, loss_first, loss_last, history: [loss per step]}
    calibration: {sequences, seq_len, tokens}; evaluation: {sequences, seq_len, tokens}
    seconds: {step: seconds}
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from crucible.moe.compensate import compensate_moe, expert_stats, moe_plan, plan_ranks
from crucible.moe.mx_experts import cache_moe_dequantized, quantizable_linears, quantize_moe
from crucible.moe.qat import LOSSES, replay_qat
from crucible.moe.routing import moe_layers, record_routes
from crucible.moe.variant_eval import (FloatReference, _check_ids, _check_int, _rows, evaluate_variant,
                                       float_reference, reference_metrics)
from crucible.quant import mxfp4

__all__ = ["VARIANTS", "MoEVariants", "quantize_variants", "compensated_matrices", "max_rank_budget",
           "default_rank_budget"]

VARIANTS = ("dense", "float", "mxfp4", "uniform", "load_aware", "qat", "uniform_qat")
_EXPERT_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>gate_up|down)_proj\.(?P<e>\d+)$")
_LINEAR_KEY = re.compile(r"\.(?P<kind>q|k|v|o)_proj$")


# --------------------------------------------------------------------------- budget

def compensated_matrices(model: nn.Module, attention: bool = True, shared: bool = True) -> dict[str, tuple[int, int]]:
    """key -> (out, in) of every matrix the compensation covers, keyed as moe_plan keys them:
    "<experts>.gate_up_proj.<e>" / "<experts>.down_proj.<e>" per expert, then the linears quantize_moe
    quantizes besides the experts (attention q/k/v/o if `attention`, dense-layer MLPs, a shared
    expert's linears if `shared`). `model` is the float MoE."""
    out: dict[str, tuple[int, int]] = {}
    for name, block in moe_layers(model).items():
        e, two_i, h = block.experts.gate_up_proj.shape
        for kind, shape in (("gate_up", (two_i, h)), ("down", (h, two_i // 2))):
            for j in range(e):
                out[f"{name}.experts.{kind}_proj.{j}"] = (int(shape[0]), int(shape[1]))
    for n in quantizable_linears(model, attention, True, shared):
        lin = model.get_submodule(n)
        out[n] = (int(lin.out_features), int(lin.in_features))
    return out


def max_rank_budget(model: nn.Module, attention: bool = True, shared: bool = True) -> int:
    """The largest total rank: the sum over compensated matrices of min(out, in)."""
    return sum(min(s) for s in compensated_matrices(model, attention, shared).values())


def default_rank_budget(model: nn.Module, attention: bool = True, per_matrix: int = 8, shared: bool = True) -> int:
    """per_matrix x the number of compensated matrices (an average rank of `per_matrix` each)."""
    return min(int(per_matrix) * len(compensated_matrices(model, attention, shared)),
               max_rank_budget(model, attention, shared))


# --------------------------------------------------------------------------- the comparison

@dataclass
class MoEVariants:
    metrics: dict
    model: nn.Module | None                     # the last trained model: load-aware + QAT (or load-aware if no QAT)
    reference: FloatReference                   # reusable for another call on the same eval_ids
    ranks: dict[str, dict[str, int]] = field(default_factory=dict)   # allocation -> key -> rank
    qat_history: list[dict] = field(default_factory=list)


def _rank_rows(plan, uniform: dict[str, int], aware: dict[str, int]) -> list[dict]:
    rows = []
    for key, layer in plan.layers.items():
        m = _EXPERT_KEY.match(key)
        if m:
            module, kind, expert = m["module"], m["kind"], int(m["e"])
        else:
            lm = _LINEAR_KEY.search(key)
            module, kind, expert = key, (lm["kind"] if lm else key.rpartition(".")[2]), None
        rows.append({"name": key, "module": module, "kind": kind, "expert": expert, "load": float(layer.load),
                     "max_rank": int(layer.max_rank), "uniform": int(uniform[key]), "load_aware": int(aware[key])})
    return rows


@contextlib.contextmanager
def _threads(n: int | None):
    """torch's intra-op threads set to n within the block (None: unchanged)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _clone_quantized(base: nn.Module) -> nn.Module:
    """A deep copy of a quantized model without duplicating the dequantized caches."""
    cache_moe_dequantized(base, False)
    out = copy.deepcopy(base)
    cache_moe_dequantized(base, True)
    cache_moe_dequantized(out, True)
    return out


def quantize_variants(moe_float: nn.Module, calib_ids: torch.Tensor, eval_ids: torch.Tensor, rank_budget: int,
                      attention: bool = True, qat_steps: int = 24, qat_lr: float = 1e-3, qat_loss: str = "kl",
                      seed: int = 0, batch_size: int = 8, mode: str = "floor", progress: bool = False,
                      dense: nn.Module | None = None, log: Callable[[dict, int], None] | None = None,
                      checkpoint_dir=None, checkpoint_every: int = 0, qat_uniform: bool = False,
                      reference: FloatReference | None = None, include_float: bool = True,
                      include_mxfp4: bool = True, qat_max_grad_norm: float | None = None,
                      svd_threads: int | None = 1, shared: bool = True) -> MoEVariants:
    """Quantize `moe_float` (a transformers MoE, float, not modified) into the variants of the module
    docstring and evaluate each on eval_ids.

    calib_ids [N, T]: calibration sequences (routes, statistics, QAT data), cut into batches of
    `batch_size` rows; eval_ids [M, T']: held-out sequences. rank_budget: the total rank over all
    compensated matrices (compensated_matrices; an int in [1, max_rank_budget]), the same for the
    uniform and the load-aware allocation. attention: quantize (and compensate) q/k/v/o too;
    shared: a shared expert's linears too (off: they stay float, as the router does).
    qat_steps (0: no QAT variant), qat_lr, qat_loss ("kl" | "hidden"), checkpoint_every, log: replay_qat's
    (`log(metrics, step)` after each QAT step of "qat"); checkpoint_dir: QAT checkpoints in
    checkpoint_dir/qat (and checkpoint_dir/uniform_qat), so a rerun with the same arguments resumes
    the training (everything before it is recomputed, deterministically).
    reference: a float_reference on eval_ids (computed when None); include_float / include_mxfp4:
    evaluate those variants (they do not depend on the calibration draw; skip them when repeating
    over seeds); "float" is the reference itself (its pass is not repeated). svd_threads: torch
    threads for the plan's SVDs (None: unchanged; LAPACK on these small matrices is fastest on one
    thread: 384 x 576 float64 0.06 s on 1 thread, 0.6-1.0 s on 2 busy cores).
    ValueError for bad arguments, before any forward pass."""
    vocab = int(moe_float.config.vocab_size)
    moe_layers(moe_float)  # ValueError for a model without MoE layers
    calib_ids = _check_ids(calib_ids, "calib_ids", vocab)
    eval_ids = _check_ids(eval_ids, "eval_ids", vocab)
    batch_size = _check_int(batch_size, "batch_size", 1)
    qat_steps = _check_int(qat_steps, "qat_steps", 0)
    _check_int(seed, "seed", 0)
    _check_int(checkpoint_every, "checkpoint_every", 0)
    top = max_rank_budget(moe_float, attention, shared)
    if isinstance(rank_budget, bool) or not isinstance(rank_budget, numbers.Integral) or not 1 <= rank_budget <= top:
        raise ValueError(f"quantize_variants: rank_budget must be an int in [1, {top}] (the total rank over the "
                         f"{len(compensated_matrices(moe_float, attention, shared))} compensated matrices, sum of min(out, in)), "
                         f"got {rank_budget!r}")
    rank_budget = int(rank_budget)
    if not (isinstance(qat_lr, numbers.Real) and math.isfinite(qat_lr) and qat_lr > 0):
        raise ValueError(f"quantize_variants: qat_lr must be a finite number > 0, got {qat_lr!r}")
    if qat_loss not in LOSSES:
        raise ValueError(f"quantize_variants: qat_loss must be one of {LOSSES}, got {qat_loss!r}")
    if mode not in mxfp4.MODES:
        raise ValueError(f"quantize_variants: mode must be one of {mxfp4.MODES}, got {mode!r}")
    if reference is not None and (tuple(eval_ids.shape) != reference.eval_shape or batch_size != reference.batch_size):
        raise ValueError(f"quantize_variants: the reference was taken on eval_ids {list(reference.eval_shape)} in "
                         f"batches of {reference.batch_size}, this call has {list(eval_ids.shape)} in batches of {batch_size}")

    torch.manual_seed(int(seed))
    seconds: dict[str, float] = {}
    variants: dict[str, dict] = {}
    was_training = moe_float.training
    moe_float.eval()

    def timed(step: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[step] = seconds.get(step, 0.0) + time.perf_counter() - t0
        return out

    if dense is not None:
        from crucible.moe.lm import perplexity

        ppl = timed("eval dense", perplexity, dense, eval_ids, batch_size, progress)
        variants["dense"] = {"perplexity": ppl, "bytes": {"total": sum(p.numel() * p.element_size() for p in
                                                                      {id(p): p for p in dense.parameters()}.values())}}
    if reference is None:
        reference = float_reference(moe_float, eval_ids, batch_size, progress)
        seconds["eval float (reference)"] = reference.seconds
    if include_float:
        variants["float"] = timed("float metrics (the reference pass)", reference_metrics, moe_float, reference)

    calib_batches = _rows(calib_ids, batch_size)
    routes = timed("record routes (calib)", record_routes, moe_float, calib_batches)
    stats = timed("expert stats (calib)", expert_stats, moe_float, calib_batches, routes, linears=attention or shared)
    with _threads(svd_threads):
        plan = timed("plan (quantization error SVD)", moe_plan, moe_float, stats, mode=mode, attention=attention,
                     shared=shared)
    del stats
    calib_load: dict[str, list[float]] = {}
    for key, layer in plan.layers.items():
        m = _EXPERT_KEY.match(key)
        if m and m["kind"] == "gate_up":
            calib_load.setdefault(m["module"].rpartition(".experts")[0], []).append(float(layer.load))

    def quantize():
        q = copy.deepcopy(moe_float)
        quantize_moe(q, attention=attention, mode=mode, shared=shared)
        return q.eval()

    base = timed("quantize (MXFP4)", quantize)
    if include_mxfp4:
        variants["mxfp4"] = timed("eval mxfp4", evaluate_variant, base, eval_ids, reference, batch_size, progress,
                                  "mxfp4")
    uniform = timed("ranks uniform", plan_ranks, plan, rank_budget, "uniform")
    aware = timed("ranks load_aware", plan_ranks, plan, rank_budget, "load_aware")
    if sum(uniform.values()) != sum(aware.values()) or sum(aware.values()) != rank_budget:
        raise AssertionError(f"quantize_variants: the allocations sum to {sum(uniform.values())} (uniform) and "
                             f"{sum(aware.values())} (load-aware), the budget is {rank_budget}")
    expert_keys = [k for k in plan.layers if _EXPERT_KEY.match(k)]
    ranks_metrics = {
        "budget": rank_budget,
        "total": {"uniform": sum(uniform.values()), "load_aware": sum(aware.values())},
        "experts_share": {a: sum(r[k] for k in expert_keys) / rank_budget for a, r in (("uniform", uniform),
                                                                                       ("load_aware", aware))},
        "weighted_error": {"uniform": plan.weighted_error(uniform), "load_aware": plan.weighted_error(aware),
                           "none": plan.weighted_error({})},
        "matrices": _rank_rows(plan, uniform, aware)}

    uq = timed("copy (uniform)", _clone_quantized, base)
    timed("compensate uniform", compensate_moe, uq, plan, uniform)
    variants["uniform"] = timed("eval uniform", evaluate_variant, uq, eval_ids, reference, batch_size, progress,
                                "uniform")
    if not (qat_uniform and qat_steps):
        del uq
        uq = None
    la = base  # the quantized base is not needed anymore: compensate it in place
    del base
    timed("compensate load_aware", compensate_moe, la, plan, aware)
    del plan
    variants["load_aware"] = timed("eval load_aware", evaluate_variant, la, eval_ids, reference, batch_size,
                                   progress, "load_aware")
    qat_info, history = None, []
    if qat_steps:
        def train(model, ckpt, logger):
            return replay_qat(model, moe_float, calib_batches, routes, steps=qat_steps, lr=float(qat_lr), loss=qat_loss,
                              checkpoint_dir=ckpt, checkpoint_every=checkpoint_every, progress=progress, seed=int(seed),
                              max_grad_norm=qat_max_grad_norm, log=logger)

        ckpt_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        history = timed("qat (from load_aware)", train, la, ckpt_dir and ckpt_dir / "qat", log)
        variants["qat"] = timed("eval qat", evaluate_variant, la, eval_ids, reference, batch_size, progress, "qat")
        losses = [float(h["loss"]) for h in history]
        qat_info = {"start": "load_aware", "steps": qat_steps, "lr": float(qat_lr), "loss": qat_loss,
                    "batches": len(calib_batches), "loss_first": losses[0], "loss_last": losses[-1], "history": losses}
        if uq is not None:
            h_u = timed("qat (from uniform)", train, uq, ckpt_dir and ckpt_dir / "uniform_qat", None)
            variants["uniform_qat"] = timed("eval uniform_qat", evaluate_variant, uq, eval_ids, reference, batch_size,
                                            progress, "uniform_qat")
            qat_info["uniform_history"] = [float(h["loss"]) for h in h_u]
            del uq
    moe_float.train(was_training)
    metrics = {
        "variants": variants,
        "ranks": ranks_metrics,
        "load_calib": calib_load,
        "qat": qat_info,
        "calibration": {"sequences": int(calib_ids.shape[0]), "seq_len": int(calib_ids.shape[1]),
                        "tokens": int(calib_ids.numel()), "batch_size": batch_size},
        "evaluation": {"sequences": int(eval_ids.shape[0]), "seq_len": int(eval_ids.shape[1]),
                       "tokens": int(eval_ids.numel())},
        "settings": {"rank_budget": rank_budget, "attention": bool(attention), "shared": bool(shared), "mode": mode, "seed": int(seed),
                     "qat_steps": qat_steps, "qat_lr": float(qat_lr), "qat_loss": qat_loss},
        "seconds": seconds,
    }
    return MoEVariants(metrics, la, reference, {"uniform": uniform, "load_aware": aware}, history)
