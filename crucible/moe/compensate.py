"""Low-rank compensation of a quantized MoE with load-aware ranks (docs/methods.md, moe).

    stats = expert_stats(float_model, batches, routes)          # per expert: routed inputs, load
    plan = moe_plan(float_model, stats, mode="floor")           # one SVD per expert matrix / linear
    ranks = plan_ranks(plan, budget=512, allocation="load_aware")   # or "uniform", same total
    compensate_moe(qmodel, plan, ranks)                         # adapters from the scaled error SVD

qmodel is the float model after crucible.moe.mx_experts.quantize_moe; a plan key is
"<experts>.gate_up_proj.<e>" / "<experts>.down_proj.<e>" for expert e's matrices and the module name
for a quantized linear.

Loads: an expert's load is the share of calibration tokens routed to it (count / tokens, the router
sends each token to k experts). Every other quantized matrix (attention q/k/v/o, Qwen3-MoE's dense
MLP layers, Qwen2-MoE's shared expert) processes every token: load 1. With "qera" scaling (s_i = sqrt(E[x_i^2]) over the
inputs the matrix actually receives) a singular value squared is then the output error per routed
token, and load x sigma^2 the error per token of the whole layer: one scale across experts and
attention. An expert no calibration token reached has load 0 and an unscaled spectrum.
plan_ranks(..., loads=...) allocates with other loads over the same spectra: the propagation-aware
ones (routed share x output-gradient sensitivity, crucible.moe.sensitivity).
"""

from __future__ import annotations

import contextlib
import numbers
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from crucible.hooks import forward_hooks
from crucible.moe.mx_experts import KINDS, MXExperts, quantizable_linears
from crucible.moe.routing import forward_batch, moe_layers, replay
from crucible.quant import lowrank, mxfp4, rank_allocation
from crucible.quant.compensate import ALLOCATIONS, SCALINGS, CompensationPlan, LayerError
from crucible.quant.linear import MXLinear

__all__ = ["ExpertStats", "MoEStats", "expert_stats", "moe_plan", "plan_ranks", "compensate_moe"]

_EXPERT_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>gate_up|down)_proj\.(?P<e>\d+)$")


# --------------------------------------------------------------------------- calibration statistics


@dataclass
class ExpertStats:
    """One MoE layer: per expert, the InputStats of the rows routed to it (H side, the input of
    gate_up_proj) and of its intermediate act(g) * u (I side, the input of down_proj), its token count."""

    gate_up: list[lowrank.InputStats]
    down: list[lowrank.InputStats]
    counts: list[int]
    tokens: int = 0

    @property
    def loads(self) -> list[float]:
        """Share of the calibration tokens routed to each expert (sums to top_k)."""
        return [c / self.tokens if self.tokens else 0.0 for c in self.counts]


@dataclass
class MoEStats:
    experts: dict[str, ExpertStats]  # experts module name -> its stats
    linears: dict[str, lowrank.InputStats] = field(default_factory=dict)


def _expert_weights(experts: nn.Module, e: int) -> torch.Tensor:
    if isinstance(experts, MXExperts):
        return experts.effective_weight("gate_up", e)
    return experts.gate_up_proj[e].detach().float()


@torch.no_grad()
def expert_stats(model: nn.Module, batches: Iterable, routes=None, linears: bool = True) -> MoEStats:
    """Calibration statistics over `batches`: for each MoE layer and expert, the inputs routed to it
    (under `replay(model, routes)` when routes are given, else the model's own routing) and their
    count; with `linears`, the InputStats of every quantizable linear (attention, dense MLPs)."""
    layers = moe_layers(model)
    stats = {}
    for name, block in layers.items():
        e = int(block.gate.weight.shape[0])
        stats[f"{name}.experts"] = ExpertStats(
            [lowrank.InputStats() for _ in range(e)], [lowrank.InputStats() for _ in range(e)], [0] * e
        )
    lin_stats = {n: lowrank.InputStats() for n in (quantizable_linears(model) if linears else [])}

    def experts_hook(name):
        st = stats[name]

        def fn(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            st.tokens += hidden.shape[0]
            for e in index.unique().tolist():
                rows = hidden[(index == e).any(-1)].float()
                g, u = F.linear(rows, _expert_weights(module, e)).chunk(2, dim=-1)
                st.gate_up[e].update(rows)
                st.down[e].update(module.act_fn(g) * u)
                st.counts[e] += rows.shape[0]

        return fn

    def linear_hook(name):
        def fn(module, args):
            lin_stats[name].update(args[0])  # returns None: a pre-hook's return value would replace args

        return fn

    expert_pairs = [(model.get_submodule(n), experts_hook(n)) for n in stats]
    linear_pairs = [(model.get_submodule(n), linear_hook(n)) for n in lin_stats]
    was_training = model.training
    model.eval()
    try:
        with (
            forward_hooks(expert_pairs, pre=True, with_kwargs=True),
            forward_hooks(linear_pairs, pre=True),
            replay(model, routes) if routes is not None else contextlib.nullcontext(),
        ):
            for batch in batches:
                forward_batch(model, batch)
    finally:
        model.train(was_training)
    if not any(s.tokens for s in stats.values()):
        raise ValueError("expert_stats: no calibration token reached the experts (empty batches?)")
    return MoEStats(stats, lin_stats)


# --------------------------------------------------------------------------- errors, ranks, adapters


def moe_plan(
    float_model: nn.Module,
    stats: MoEStats,
    mode: str = "floor",
    scaling: str = "qera",
    attention: bool = True,
    dense: bool = True,
    shared: bool = True,
) -> CompensationPlan:
    """The quantization error E = W - dequant(Q(W)) of every expert matrix (key
    "<experts>.gate_up_proj.<e>" / "<experts>.down_proj.<e>") and, with `attention` / `dense`, of the
    linears quantize_moe quantizes (their module names), each factorized once (SVD of E diag(s), s
    from the matrix's own routed inputs), with its load (see the module docstring)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if mode not in mxfp4.MODES:
        raise ValueError(f"mode must be one of {mxfp4.MODES}, got {mode!r}")
    layers: dict[str, LayerError] = {}
    for block_name, block in moe_layers(float_model).items():
        name = f"{block_name}.experts"
        if isinstance(block.experts, MXExperts):
            raise ValueError(f"moe_plan: {name} is quantized; pass the float model")
        if name not in stats.experts:
            raise ValueError(f"moe_plan: the statistics hold no layer {name!r} (they have {list(stats.experts)[:3]})")
        st = stats.experts[name]
        for kind, side in (("gate_up", st.gate_up), ("down", st.down)):
            weights = getattr(block.experts, f"{kind}_proj").detach().float()
            if len(side) != weights.shape[0]:
                raise ValueError(
                    f"moe_plan: statistics of {name} are for {len(side)} experts, the model has {weights.shape[0]}"
                )
            for e in range(weights.shape[0]):
                w = weights[e]
                err = w - mxfp4.dequantize(mxfp4.quantize(w, mode=mode, pad=True))
                s = None if scaling == "plain" or side[e].count == 0 else side[e].scale(scaling)
                key = f"{name}.{kind}_proj.{e}"
                layers[key] = LayerError(key, tuple(w.shape), lowrank.factorize(err, s), float(st.loads[e]))
    for n in quantizable_linears(float_model, attention, dense, shared):
        lin = float_model.get_submodule(n)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"moe_plan: {n} is {type(lin).__name__}; pass the float model")
        if scaling != "plain" and (n not in stats.linears or stats.linears[n].count == 0):
            raise ValueError(
                f"moe_plan: scaling {scaling!r} needs calibration statistics of {n!r} (expert_stats(linears=True))"
            )
        w = lin.weight.detach().float()
        err = w - mxfp4.dequantize(mxfp4.quantize(w, mode=mode))
        s = None if scaling == "plain" else stats.linears[n].scale(scaling)
        layers[n] = LayerError(n, tuple(w.shape), lowrank.factorize(err, s), 1.0)
    return CompensationPlan(layers, mode, scaling, "routed")


def plan_ranks(
    plan: CompensationPlan | Mapping[str, LayerError],
    budget: int,
    allocation: str = "load_aware",
    loads: Mapping[str, float] | None = None,
) -> dict[str, int]:
    """key -> rank, summing to `budget`: "load_aware" gives rank units by the largest marginal gain
    load * sigma^2 (allocate_ranks, optimal for the load-weighted discarded energy), "uniform"
    spreads the same budget evenly (uniform_ranks). `loads` (key -> load, one for every matrix of
    the plan) replaces the plan's routed loads, e.g. the propagation-aware ones of
    crucible.moe.sensitivity. ValueError for an unknown allocation, missing loads or a budget that
    is not an int in [0, total rank]."""
    layers = plan.layers if isinstance(plan, CompensationPlan) else dict(plan)
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if loads is not None:
        missing = [n for n in layers if n not in loads]
        if missing:
            raise ValueError(
                f"plan_ranks: loads for {len(layers) - len(missing)} of the {len(layers)} matrices; "
                f"none for {missing[:3]}"
            )
    total = sum(lay.max_rank for lay in layers.values())
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or not 0 <= budget <= total:
        raise ValueError(
            f"rank budget must be an int in [0, {total}] (the summed rank of the {len(layers)} "
            f"matrices), got {budget!r}"
        )
    names = list(layers)
    if allocation == "uniform":
        r = rank_allocation.uniform_ranks([layers[n].max_rank for n in names], int(budget))
    else:
        weights = [float(loads[n]) if loads is not None else layers[n].load for n in names]
        r = rank_allocation.allocate_ranks([layers[n].spectrum for n in names], weights, int(budget))
    return dict(zip(names, (int(x) for x in r)))


def compensate_moe(qmodel: nn.Module, plan: CompensationPlan, ranks: Mapping[str, int]) -> dict[str, int]:
    """Set the adapters of `qmodel` (quantize_moe'd with plan.mode) from the plan's truncated SVDs at
    `ranks` (key -> rank; every matrix of the plan not in ranks gets rank 0). Returns the ranks set."""
    unknown = sorted(set(ranks) - set(plan.layers))
    if unknown:
        raise ValueError(f"compensate_moe: ranks for {unknown[:3]}, which the plan does not hold")
    experts: dict[str, dict[str, list]] = {}
    linears: dict[str, MXLinear] = {}
    for key in plan.layers:
        m = _EXPERT_KEY.match(key)
        target = m["module"] if m else key
        try:
            module = qmodel.get_submodule(target)
        except AttributeError:
            raise ValueError(
                f"compensate_moe: the quantized model has no module {target!r} (plan key {key!r})"
            ) from None
        want = MXExperts if m else MXLinear
        if not isinstance(module, want):
            raise ValueError(
                f"compensate_moe: {target!r} is {type(module).__name__}, expected {want.__name__}; "
                f"run quantize_moe first"
            )
        if module.mode != plan.mode:
            raise ValueError(
                f"compensate_moe: {target!r} is quantized in mode {module.mode!r}, the plan in {plan.mode!r}"
            )
        if m:
            experts.setdefault(target, {k: [None] * module.num_experts for k in KINDS})
            experts[target][m["kind"]][int(m["e"])] = key
        else:
            linears[key] = module
    out = {}
    for target, kinds in experts.items():
        module = qmodel.get_submodule(target)
        for kind, keys in kinds.items():
            factors = []
            for key in keys:
                r = int(ranks.get(key, 0)) if key else 0
                factors.append(lowrank.compensate(plan.layers[key].svd, r) if r else None)
                if key:
                    out[key] = r
            module.set_adapters(kind, factors)
    for key, module in linears.items():
        r = int(ranks.get(key, 0))
        module.set_adapter(*lowrank.compensate(plan.layers[key].svd, r))
        out[key] = r
    return out
