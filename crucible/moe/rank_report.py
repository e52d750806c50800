"""The rank budget of a MoE's compensation and where the allocations put it (docs/methods.md, moe).

    compensated_matrices(moe)                  # key -> (out, in) of every matrix compensate.moe_plan covers
    default_rank_budget(moe)                   # 8 x the number of those matrices
    rank_metrics(plan, {"uniform": r_u, "load_aware": r_la}, prop_loads)   # quantize_variants' metrics["ranks"]

A key is moe_plan's: "<experts>.gate_up_proj.<e>" / "<experts>.down_proj.<e>" per expert, else the
module name of a quantized linear. Each matrix belongs to one group: "experts" (routed experts),
"attention" (q/k/v/o), "shared" (a shared expert's gate/up/down), "dense" (the MLP of a dense decoder
layer), and to the decoder layer whose index its name carries.
"""

from __future__ import annotations

import re
from typing import Mapping

from torch import nn

from crucible.moe.mx_experts import ATTENTION_PATTERN, SHARED_PATTERN, quantizable_linears
from crucible.moe.routing import moe_layers
from crucible.quant import rank_allocation

__all__ = [
    "compensated_matrices",
    "max_rank_budget",
    "default_rank_budget",
    "matrix_group",
    "matrix_layer",
    "rank_metrics",
    "GROUPS",
]

GROUPS = ("experts", "attention", "shared", "dense")
_EXPERT_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>gate_up|down)_proj\.(?P<e>\d+)$")
_LINEAR_KEY = re.compile(r"\.(?P<kind>q|k|v|o|gate|up|down)_proj$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def compensated_matrices(model: nn.Module, attention: bool = True, shared: bool = True) -> dict[str, tuple[int, int]]:
    """key -> (out, in) of every matrix the compensation covers: each expert's gate_up and down, then
    the linears quantize_moe quantizes besides the experts (attention q/k/v/o if `attention`,
    dense-layer MLPs, a shared expert's linears if `shared`). `model` is the float MoE."""
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
    return min(
        int(per_matrix) * len(compensated_matrices(model, attention, shared)), max_rank_budget(model, attention, shared)
    )


def matrix_group(key: str) -> str:
    """ "experts", "attention", "shared" or "dense" (see the module docstring)."""
    if _EXPERT_KEY.match(key):
        return "experts"
    if re.search(ATTENTION_PATTERN, key):
        return "attention"
    if re.search(SHARED_PATTERN, key):
        return "shared"
    return "dense"


def matrix_layer(key: str) -> int:
    """The decoder layer index in the key's name (-1 if it names none)."""
    m = _LAYER.search(key)
    return int(m[1]) if m else -1


def _row(key: str, layer, loads: Mapping[str, Mapping[str, float]], ranks: Mapping[str, Mapping[str, int]]) -> dict:
    m = _EXPERT_KEY.match(key)
    if m:
        module, kind, expert = m["module"], m["kind"], int(m["e"])
    else:
        lm = _LINEAR_KEY.search(key)
        module, kind, expert = key, (lm["kind"] if lm else key.rpartition(".")[2]), None
    row = {
        "name": key,
        "module": module,
        "kind": kind,
        "expert": expert,
        "layer": matrix_layer(key),
        "group": matrix_group(key),
        "max_rank": int(layer.max_rank),
    }
    row.update({name: float(v[key]) for name, v in loads.items()})
    row.update({name: int(r[key]) for name, r in ranks.items()})
    return row


def rank_metrics(plan, ranks: Mapping[str, Mapping[str, int]], prop_loads: Mapping[str, float] | None = None) -> dict:
    """Where each allocation put the rank (JSON-serialisable). `plan`: compensate.moe_plan's (its
    loads are the routed ones); ranks: allocation name -> key -> rank (each summing to the budget);
    prop_loads: the propagation-aware loads (crucible.moe.sensitivity), if measured.

    {budget, total: {alloc: sum}, experts_share: {alloc: share of the budget on expert matrices},
     groups: {alloc: {group: rank}}, layers: {alloc: [rank per decoder layer]},
     weighted_error: {alloc: sum_i load_i sum_{j > r_i} sigma_ij^2 under the routed loads, none: at rank 0},
     weighted_error_prop: the same under prop_loads (absent without them),
     matrices: [{name, module, kind, expert, layer, group, max_rank, load, load_prop?, <alloc>: rank}]}"""
    names = list(plan.layers)
    totals = {a: sum(int(r.get(k, 0)) for k in names) for a, r in ranks.items()}
    budget = next(iter(totals.values()), 0)
    n_layers = max((matrix_layer(k) for k in names), default=-1) + 1
    spectra = [plan.layers[k].spectrum for k in names]

    def werr(loads):
        w = [float(loads[k]) for k in names]
        out = {
            a: rank_allocation.weighted_error(spectra, w, [int(r.get(k, 0)) for k in names]) for a, r in ranks.items()
        }
        out["none"] = rank_allocation.weighted_error(spectra, w, [0] * len(names))
        return out

    routed = {k: float(plan.layers[k].load) for k in names}
    loads = {"load": routed, **({"load_prop": dict(prop_loads)} if prop_loads is not None else {})}
    out = {
        "budget": budget,
        "total": totals,
        "experts_share": {
            a: (sum(int(r.get(k, 0)) for k in names if matrix_group(k) == "experts") / budget if budget else 0.0)
            for a, r in ranks.items()
        },
        "groups": {
            a: {g: sum(int(r.get(k, 0)) for k in names if matrix_group(k) == g) for g in GROUPS}
            for a, r in ranks.items()
        },
        "layers": {
            a: [sum(int(r.get(k, 0)) for k in names if matrix_layer(k) == i) for i in range(n_layers)]
            for a, r in ranks.items()
        },
        "weighted_error": werr(routed),
    }
    if prop_loads is not None:
        out["weighted_error_prop"] = werr(prop_loads)
    out["matrices"] = [_row(k, plan.layers[k], loads, ranks) for k in names]
    return out
