"""The MoE quantization comparison in one function (docs/methods.md, moe; issue: MoE quantization):
float MoE, MXFP4, MXFP4 + uniform compensation, MXFP4 + load-aware compensation with the routed load,
MXFP4 + load-aware compensation with the propagation-aware load (all three at the same total rank),
and limited routing replay QAT from the best compensated model, each scored on held-out sequences.

    ref = float_reference(moe, eval_ids)                          # optional (crucible.moe.variant_eval)
    out = quantize_variants(moe, calib_ids, eval_ids, rank_budget=default_rank_budget(moe),
                            qat_steps=24, qat_lr=1e-3, seed=0, dense=dense, reference=ref)
    out.metrics["variants"]["load_aware_prop"]["perplexity"]; out.model   # the QAT model

Steps (each timed in metrics["seconds"]):
1. float reference on eval_ids (once; `reference` reuses one): the float MoE's perplexity, its top-k
   routes and its hidden states (output_hidden_states, kept in RAM for the drift);
2. record the float MoE's routes on the calibration batches (calib_ids cut into rows of
   `batch_size`); expert_stats under those routes (routed inputs, loads; linear inputs);
3. moe_plan: the quantization error of every expert matrix and compensated linear (attention
   q/k/v/o if `attention`, the shared expert if `shared`) factorized once (qera scaling), shared by
   every allocation; with `propagation`, crucible.moe.sensitivity.output_sensitivity under the same
   routes: each matrix's routed share x the mean squared gradient of the next-token loss w.r.t. its
   output (the dense quantize stage's output sensitivity, per expert for the fused experts);
4. quantize a deep copy of the float MoE (quantize_moe: experts, q/k/v/o with `attention`, the shared
   expert with `shared`, in MXFP4; router, shared-expert gate, embeddings, norms, lm_head float):
   variant "mxfp4";
5. ranks at the same total `rank_budget` (asserted equal), each set from the plan's truncated SVDs
   (compensate_moe): "uniform" (equal ranks), "load_aware" (allocate_ranks with the routed loads:
   an expert's share of the tokens, 1 for every other matrix) and, with `propagation`,
   "load_aware_prop" (allocate_ranks with the propagation-aware loads);
6. replay QAT (crucible.moe.qat.replay_qat) from one compensated model: with qat_start "best" the one
   with the lowest calibration KL to the float MoE (variant_eval.calibration_fit on the calibration
   batches, each model routing by itself; chosen without looking at eval_ids), else the named
   one. Frozen router and MXFP4 codes, the float MoE's calibration routes replayed, only the expert
   adapters train toward the float MoE's next-token distributions: variant "qat".
Every variant is evaluated by crucible.moe.variant_eval.evaluate_variant against the float
reference ("float" is the reference pass itself); "dense" (perplexity only) when `dense` is given.

At most four models are alive at once (the float MoE, the quantized base, one compensated candidate,
the best candidate so far), and while candidates are scored the float MoE's calibration log-probs
(calibration tokens x vocabulary floats); the plan (float64 SVDs) is dropped before QAT unless kept
(keep_calibration). Deterministic given
`seed` (torch.manual_seed; the QAT batch order is seeded; nothing else draws random numbers); only
metrics["seconds"] varies between runs.

metrics (JSON-serialisable):
    variants: {name: evaluate_variant's metrics (crucible.moe.variant_eval)}   ("dense": perplexity, bytes)
    ranks: crucible.moe.rank_report.rank_metrics (per allocation: totals, groups, layers, weighted
           errors; one row per matrix with its routed load, propagation-aware load and ranks)
    load_calib: {layer: [E shares of the calibration tokens (float routes), each row summing to top_k]}
    selection: {by: "calibration kl", candidates: {name: {kl, perplexity}}, start}   (with QAT)
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
from crucible.moe.mx_experts import cache_moe_dequantized, quantize_moe
from crucible.moe.qat import LOSSES, replay_qat
from crucible.moe.rank_report import compensated_matrices, default_rank_budget, max_rank_budget, rank_metrics
from crucible.moe.routing import Routes, moe_layers, record_routes
from crucible.moe.sensitivity import output_sensitivity
from crucible.moe.variant_eval import (
    FloatReference,
    _check_ids,
    _check_int,
    _rows,
    calibration_fit,
    evaluate_variant,
    float_log_probs,
    float_reference,
    reference_metrics,
)
from crucible.quant import mxfp4
from crucible.quant.compensate import CompensationPlan

__all__ = [
    "VARIANTS",
    "COMPENSATED",
    "MoEVariants",
    "Calibration",
    "quantize_variants",
    "compensated_matrices",
    "max_rank_budget",
    "default_rank_budget",
]

VARIANTS = ("dense", "float", "mxfp4", "uniform", "load_aware", "load_aware_prop", "qat")
COMPENSATED = ("uniform", "load_aware", "load_aware_prop")
_EXPERT_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>gate_up|down)_proj\.(?P<e>\d+)$")


# --------------------------------------------------------------------------- the comparison


@dataclass
class Calibration:
    """What steps 2-3 derive from the float MoE and one calibration draw: the routes, the plan and the
    propagation-aware loads. Every matrix's SVD and load is its own, so the plan of a setting that
    quantizes fewer linears (shared or attention off) is a subset of this one's: quantize_variants
    (keep_calibration=True) returns it, and a call with `calibration=` on the same calib_ids, batch
    size and mode reuses it instead of recomputing (the same numbers, less time)."""

    calib_ids: torch.Tensor
    batch_size: int
    mode: str
    routes: Routes
    plan: CompensationPlan
    prop: dict[str, float] | None


@dataclass
class MoEVariants:
    metrics: dict
    model: nn.Module | None  # the QAT model (without QAT: the best compensated one)
    reference: FloatReference  # reusable for another call on the same eval_ids
    ranks: dict[str, dict[str, int]] = field(default_factory=dict)  # allocation -> key -> rank
    qat_history: list[dict] = field(default_factory=list)
    calibration: Calibration | None = None  # with keep_calibration


def _reuse(calibration: Calibration, moe_float, calib_ids, batch_size, mode, attention, shared, propagation):
    """(routes, plan, prop) of this setting from a kept Calibration; ValueError if it does not fit."""
    if (
        tuple(calibration.calib_ids.shape) != tuple(calib_ids.shape)
        or not torch.equal(calibration.calib_ids, calib_ids)
        or calibration.batch_size != batch_size
        or calibration.mode != mode
    ):
        raise ValueError("quantize_variants: the calibration was kept for other calib_ids, batch_size or mode")
    need = compensated_matrices(moe_float, attention, shared)
    missing = [k for k in need if k not in calibration.plan.layers]
    if missing:
        raise ValueError(
            f"quantize_variants: the kept calibration has no plan for {missing[:3]} (keep it from the "
            f"setting that compensates the most matrices)"
        )
    if propagation and calibration.prop is None:
        raise ValueError("quantize_variants: the kept calibration has no propagation-aware loads (propagation=False)")
    old = calibration.plan
    plan = CompensationPlan({k: v for k, v in old.layers.items() if k in need}, old.mode, old.scaling, old.load)
    return calibration.routes, plan, ({k: calibration.prop[k] for k in plan.layers} if propagation else None)


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


def _check_args(
    moe_float,
    calib_ids,
    eval_ids,
    rank_budget,
    attention,
    shared,
    batch_size,
    qat_steps,
    seed,
    checkpoint_every,
    qat_lr,
    qat_loss,
    mode,
    reference,
    qat_start,
    propagation,
):
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
        raise ValueError(
            f"quantize_variants: rank_budget must be an int in [1, {top}] (the total rank over the "
            f"{len(compensated_matrices(moe_float, attention, shared))} compensated matrices, sum of "
            f"min(out, in)), got {rank_budget!r}"
        )
    if not (isinstance(qat_lr, numbers.Real) and math.isfinite(qat_lr) and qat_lr > 0):
        raise ValueError(f"quantize_variants: qat_lr must be a finite number > 0, got {qat_lr!r}")
    if qat_loss not in LOSSES:
        raise ValueError(f"quantize_variants: qat_loss must be one of {LOSSES}, got {qat_loss!r}")
    if mode not in mxfp4.MODES:
        raise ValueError(f"quantize_variants: mode must be one of {mxfp4.MODES}, got {mode!r}")
    allowed = ("best", *COMPENSATED[: 2 + bool(propagation)])
    if qat_start not in allowed:
        raise ValueError(f"quantize_variants: qat_start must be one of {allowed}, got {qat_start!r}")
    if reference is not None and (tuple(eval_ids.shape) != reference.eval_shape or batch_size != reference.batch_size):
        raise ValueError(
            f"quantize_variants: the reference was taken on eval_ids {list(reference.eval_shape)} in "
            f"batches of {reference.batch_size}, this call has {list(eval_ids.shape)} in batches of {batch_size}"
        )
    return calib_ids, eval_ids, batch_size, qat_steps, int(rank_budget)


def quantize_variants(
    moe_float: nn.Module,
    calib_ids: torch.Tensor,
    eval_ids: torch.Tensor,
    rank_budget: int,
    attention: bool = True,
    qat_steps: int = 24,
    qat_lr: float = 1e-3,
    qat_loss: str = "kl",
    seed: int = 0,
    batch_size: int = 8,
    mode: str = "floor",
    progress: bool = False,
    dense: nn.Module | None = None,
    log: Callable[[dict, int], None] | None = None,
    checkpoint_dir=None,
    checkpoint_every: int = 0,
    reference: FloatReference | None = None,
    include_float: bool = True,
    include_mxfp4: bool = True,
    qat_max_grad_norm: float | None = None,
    svd_threads: int | None = 1,
    shared: bool = True,
    propagation: bool = True,
    qat_start: str = "best",
    keep_calibration: bool = False,
    calibration: Calibration | None = None,
) -> MoEVariants:
    """Quantize `moe_float` (a transformers MoE, float, not modified) into the variants of the module
    docstring and evaluate each on eval_ids.

    calib_ids [N, T]: calibration sequences (routes, statistics, sensitivities, the QAT start's choice,
    QAT data), cut into batches of `batch_size` rows; eval_ids [M, T']: held-out sequences.
    rank_budget: the total rank over all compensated matrices (compensated_matrices; an int in [1,
    max_rank_budget]), the same for every allocation. attention: quantize (and compensate) q/k/v/o
    too; shared: a shared expert's linears too (off: they stay float, as the router does);
    propagation: measure the propagation-aware loads and add "load_aware_prop". qat_start: "best"
    (lowest calibration KL among the compensated variants) or one of them by name.
    qat_steps (0: no QAT variant), qat_lr, qat_loss ("kl" | "hidden"), checkpoint_every, log: replay_qat's
    (`log(metrics, step)` after each QAT step); checkpoint_dir: QAT checkpoints in checkpoint_dir/qat,
    so a rerun with the same arguments resumes the training (everything before it is recomputed,
    deterministically). reference: a float_reference on eval_ids (computed when None);
    include_float / include_mxfp4: evaluate those variants (they do not depend on the calibration
    draw; skip them when repeating over seeds); "float" is the reference itself. svd_threads: torch
    threads for the plan's SVDs (None: unchanged; LAPACK on these small matrices is fastest on one
    thread: 384 x 576 float64 0.06 s on 1 thread, 0.6-1.0 s on 2 busy cores). keep_calibration:
    return the routes, plan and loads (MoEVariants.calibration; it holds the plan's SVDs in RAM);
    calibration: such a kept one, reused for this call (see Calibration).
    ValueError for bad arguments, before any forward pass."""
    calib_ids, eval_ids, batch_size, qat_steps, rank_budget = _check_args(
        moe_float,
        calib_ids,
        eval_ids,
        rank_budget,
        attention,
        shared,
        batch_size,
        qat_steps,
        seed,
        checkpoint_every,
        qat_lr,
        qat_loss,
        mode,
        reference,
        qat_start,
        propagation,
    )
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
        variants["dense"] = {
            "perplexity": ppl,
            "bytes": {
                "total": sum(p.numel() * p.element_size() for p in {id(p): p for p in dense.parameters()}.values())
            },
        }
    if reference is None:
        reference = float_reference(moe_float, eval_ids, batch_size, progress)
        seconds["eval float (reference)"] = reference.seconds
    if include_float:
        variants["float"] = timed("float metrics (the reference pass)", reference_metrics, moe_float, reference)

    calib_batches = _rows(calib_ids, batch_size)
    if calibration is not None:
        routes, plan, prop = timed(
            "calibration (reused)",
            _reuse,
            calibration,
            moe_float,
            calib_ids,
            batch_size,
            mode,
            attention,
            shared,
            propagation,
        )
    else:
        routes = timed("record routes (calib)", record_routes, moe_float, calib_batches)
        stats = timed(
            "expert stats (calib)", expert_stats, moe_float, calib_batches, routes, linears=attention or shared
        )
        with _threads(svd_threads):
            plan = timed(
                "plan (quantization error SVD)",
                moe_plan,
                moe_float,
                stats,
                mode=mode,
                attention=attention,
                shared=shared,
            )
        del stats
        prop = None
        if propagation:
            sens = timed(
                "output sensitivity (calib)",
                output_sensitivity,
                moe_float,
                calib_batches,
                routes,
                attention=attention,
                shared=shared,
            )
            prop = {k: sens[k].load for k in plan.layers}
    kept = Calibration(calib_ids, batch_size, mode, routes, plan, prop) if keep_calibration else None
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
        variants["mxfp4"] = timed(
            "eval mxfp4", evaluate_variant, base, eval_ids, reference, batch_size, progress, "mxfp4"
        )
    ranks = {
        "uniform": timed("ranks uniform", plan_ranks, plan, rank_budget, "uniform"),
        "load_aware": timed("ranks load_aware", plan_ranks, plan, rank_budget, "load_aware"),
    }
    if prop is not None:
        ranks["load_aware_prop"] = timed("ranks load_aware_prop", plan_ranks, plan, rank_budget, "load_aware", prop)
    sums = {a: sum(r.values()) for a, r in ranks.items()}
    if set(sums.values()) != {rank_budget}:
        raise AssertionError(f"quantize_variants: the allocations sum to {sums}, the budget is {rank_budget}")
    ranks_metrics = rank_metrics(plan, ranks, prop)

    candidates: dict[str, dict] = {}
    best, best_name, float_logp = None, None, None
    names = list(ranks)
    for i, name in enumerate(names):
        # the last allocation compensates the quantized base itself: it is not needed afterwards
        model = base if i == len(names) - 1 else timed(f"copy ({name})", _clone_quantized, base)
        timed(f"compensate {name}", compensate_moe, model, plan, ranks[name])
        variants[name] = timed(f"eval {name}", evaluate_variant, model, eval_ids, reference, batch_size, progress, name)
        if qat_steps and qat_start == "best":
            if float_logp is None:
                float_logp = timed("float log-probs (calib)", float_log_probs, moe_float, calib_batches)
            candidates[name] = timed(
                f"calibration fit {name}", calibration_fit, model, moe_float, calib_batches, float_logp
            )
            better = best is None or candidates[name]["kl"] < candidates[best_name]["kl"]
        else:
            better = name == (names[-1] if qat_start == "best" else qat_start)
        if better:
            best, best_name = model, name
        del model
    del base, plan, float_logp
    selection, qat_info, history = None, None, []
    if qat_steps:
        selection = {
            "by": "calibration kl" if qat_start == "best" else "named",
            "candidates": candidates,
            "start": best_name,
        }
        ckpt_dir = None if checkpoint_dir is None else Path(checkpoint_dir) / "qat"
        history = timed(
            f"qat (from {best_name})",
            replay_qat,
            best,
            moe_float,
            calib_batches,
            routes,
            steps=qat_steps,
            lr=float(qat_lr),
            loss=qat_loss,
            checkpoint_dir=ckpt_dir,
            checkpoint_every=checkpoint_every,
            progress=progress,
            seed=int(seed),
            max_grad_norm=qat_max_grad_norm,
            log=log,
        )
        variants["qat"] = timed("eval qat", evaluate_variant, best, eval_ids, reference, batch_size, progress, "qat")
        losses = [float(h["loss"]) for h in history]
        qat_info = {
            "start": best_name,
            "steps": qat_steps,
            "lr": float(qat_lr),
            "loss": qat_loss,
            "batches": len(calib_batches),
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "history": losses,
        }
    moe_float.train(was_training)
    metrics = {
        "variants": variants,
        "ranks": ranks_metrics,
        "load_calib": calib_load,
        "selection": selection,
        "qat": qat_info,
        "calibration": {
            "sequences": int(calib_ids.shape[0]),
            "seq_len": int(calib_ids.shape[1]),
            "tokens": int(calib_ids.numel()),
            "batch_size": batch_size,
        },
        "evaluation": {
            "sequences": int(eval_ids.shape[0]),
            "seq_len": int(eval_ids.shape[1]),
            "tokens": int(eval_ids.numel()),
        },
        "settings": {
            "rank_budget": rank_budget,
            "attention": bool(attention),
            "shared": bool(shared),
            "mode": mode,
            "seed": int(seed),
            "propagation": bool(propagation),
            "qat_start": qat_start,
            "qat_steps": qat_steps,
            "qat_lr": float(qat_lr),
            "qat_loss": qat_loss,
        },
        "seconds": seconds,
    }
    return MoEVariants(metrics, best, reference, ranks, history, kept)
