"""MXFP4 experts with per-expert low-rank compensation, load-aware ranks (METHODS.md sec. 4).

    quantize_moe(qmodel, attention=True, mode="floor")         # in place: MXExperts (+ MXLinear q/k/v/o)
    stats = expert_stats(float_model, batches, routes)          # per expert: routed inputs, load
    plan = moe_plan(float_model, stats, mode="floor")           # one SVD per expert matrix / linear
    ranks = plan_ranks(plan, budget=512, allocation="load_aware")   # or "uniform", same total
    compensate_moe(qmodel, plan, ranks)                         # adapters from the scaled error SVD
    moe_nbytes(qmodel)                                          # bytes by kind, bits per weight
    save_quantized_moe(qmodel, "moe.safetensors"); load_quantized_moe("moe.safetensors", skeleton)

`MXExperts` replaces transformers' fused experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
Mixtral / Qwen3-MoE): each expert's two matrices are MXFP4 along their input dimension (H resp. I,
zero-padded to a multiple of 32 when needed, crucible.quant.mxfp4), packed uint8 codes and E8M0
scales held as buffers, plus optional low-rank adapters whose rank differs per expert. Expert e
computes, as the original eager experts do,
    g, u = chunk(x W_gu,e^T, 2);  y = (act(g) * u) W_d,e^T;  out[t] += w[t, j] * y  for e = index[t, j]
with W_e = dequant(Q(W_e)) + A_e B_e. The adapters of one matrix kind are held concatenated over the
experts (`gate_up_lora_a` [2I, sum_e r_e], `gate_up_lora_b` [sum_e r_e, H]; likewise `down_lora_*`),
expert e owning columns / rows offsets[e]:offsets[e+1], so each kind is one trainable parameter pair
whatever the per-expert ranks. The class is not decorated with transformers'
`use_experts_implementation` (the original's forward is swapped by `config._experts_implementation`,
grouped_mm by default); MXExperts is a plain module whose forward is always its own.

Loads: an expert's load is the share of calibration tokens routed to it (count / tokens, the router
sends each token to k experts). Every other quantized matrix (attention q/k/v/o, Qwen3-MoE's dense
MLP layers) processes every token: load 1. With "qera" scaling (s_i = sqrt(E[x_i^2]) over the
inputs the matrix actually receives) a singular value squared is then the output error per routed
token, and load x sigma^2 the error per token of the whole layer: one scale across experts and
attention. An expert no calibration token reached has load 0 and an unscaled spectrum.
The router (`mlp.gate`), embeddings, lm_head and norms stay in float.

Adapter values are rounded to `adapter_dtype` (bfloat16 by default, as crucible's MXLinear) when
set, so a saved and reloaded model computes exactly what the in-memory one did; `round_adapters`
re-rounds after training. `cache_moe_dequantized` keeps the dequantized experts in RAM between
calls (never in the state dict or the file).

File (one safetensors file): every tensor of the quantized model's state dict (packed and scales
uint8, adapters in adapter_dtype, only when rank > 0), a tensor sharing storage with an earlier one
(tied embeddings) written once; metadata "crucible.moe" = JSON {experts: {name: {num_experts,
hidden, intermediate, mode, gate_up_ranks, down_ranks}}, linears: {name: {in, out, mode, rank}},
adapter_dtype, tied: {name: name written}}.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from crucible.hooks import forward_hooks
from crucible.moe.routing import forward_batch, moe_layers, read_safetensors, replay
from crucible.quant import lowrank, mxfp4
from crucible.quant.compensate import ALLOCATIONS, SCALINGS, CompensationPlan, LayerError
from crucible.quant.linear import ADAPTER_DTYPES, MXLinear, quantize_model

__all__ = ["MXExperts", "quantize_moe", "quantizable_linears", "cache_moe_dequantized", "round_adapters",
           "ExpertStats", "MoEStats", "expert_stats", "moe_plan", "plan_ranks", "compensate_moe", "moe_nbytes",
           "save_quantized_moe", "load_quantized_moe", "ATTENTION_PATTERN", "DENSE_MLP_PATTERN"]

KINDS = ("gate_up", "down")
ATTENTION_PATTERN = r"\.self_attn\.(q|k|v|o)_proj$"
DENSE_MLP_PATTERN = r"\.mlp\.(gate|up|down)_proj$"  # Qwen3-MoE's dense layers; a SparseMoeBlock has none
_EXPERT_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>gate_up|down)_proj\.(?P<e>\d+)$")


def _padded(k: int) -> int:
    return -(-k // mxfp4.BLOCK) * mxfp4.BLOCK


# --------------------------------------------------------------------------- the module

class MXExperts(nn.Module):
    """Fused MoE experts in MXFP4 with per-expert low-rank adapters (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, gate_up_packed: torch.Tensor,
                 gate_up_scales: torch.Tensor, down_packed: torch.Tensor, down_scales: torch.Tensor, act_fn: nn.Module,
                 mode: str = "floor", adapter_dtype: str = "bfloat16"):
        super().__init__()
        if adapter_dtype not in ADAPTER_DTYPES:
            raise ValueError(f"adapter_dtype must be one of {sorted(ADAPTER_DTYPES)}, got {adapter_dtype!r}")
        if mode not in mxfp4.MODES:
            raise ValueError(f"mode must be one of {mxfp4.MODES}, got {mode!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = int(num_experts), int(hidden_dim), int(intermediate_dim)
        self.mode, self.adapter_dtype = mode, adapter_dtype
        mxfp4.check_packed(gate_up_packed, gate_up_scales, self.weight_shape("gate_up"), where="MXExperts gate_up_proj")
        mxfp4.check_packed(down_packed, down_scales, self.weight_shape("down"), where="MXExperts down_proj")
        self.register_buffer("gate_up_packed", gate_up_packed.contiguous())
        self.register_buffer("gate_up_scales", gate_up_scales.contiguous())
        self.register_buffer("down_packed", down_packed.contiguous())
        self.register_buffer("down_scales", down_scales.contiguous())
        self.act_fn = act_fn
        self.ranks = {k: [0] * self.num_experts for k in KINDS}
        for k in KINDS:
            out, inp = self.weight_shape(k)[1:]
            setattr(self, f"{k}_lora_a", nn.Parameter(torch.zeros(out, 0)))
            setattr(self, f"{k}_lora_b", nn.Parameter(torch.zeros(0, inp)))
        self.cache_dequantized = False
        self._dense_cache: dict = {}

    @classmethod
    def from_experts(cls, experts: nn.Module, mode: str = "floor", adapter_dtype: str = "bfloat16",
                     name: str = "experts") -> "MXExperts":
        """Quantize transformers' fused experts. ValueError naming `name` for a non-finite weight or a
        layout other than concatenated [gate; up], untransposed, without bias."""
        for attr, ok in (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True)):
            if getattr(experts, attr, ok) != ok:
                raise ValueError(f"{name}: experts with {attr}={getattr(experts, attr)} are not supported (MXExperts "
                                 f"holds gate_up_proj [E, 2I, H] as [gate; up] and down_proj [E, H, I], no bias)")
        gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3):
            raise ValueError(f"{name}: expected 3-D gate_up_proj and down_proj parameters, got {type(experts).__name__}")
        e, two_i, h = gu.shape
        if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
            raise ValueError(f"{name}: gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} do not fit "
                             f"[E, 2I, H] and [E, H, I]")
        packs = []
        for leaf, w in (("gate_up_proj", gu), ("down_proj", dn)):
            w = w.detach().to(torch.float32)
            if not bool(torch.isfinite(w).all()):
                bad = (~torch.isfinite(w)).nonzero()[0].tolist()
                raise ValueError(f"{name}.{leaf}: non-finite value {w[tuple(bad)].item()} at {bad}; cannot quantize")
            q = mxfp4.quantize(w, mode=mode, pad=True)
            packs += [q.packed, q.scales]
        return cls(e, h, two_i // 2, *packs, act_fn=experts.act_fn, mode=mode, adapter_dtype=adapter_dtype)

    def weight_shape(self, kind: str) -> tuple[int, int, int]:
        """[E, out, in] of the matrix kind "gate_up" ([E, 2I, H]) or "down" ([E, H, I])."""
        if kind == "gate_up":
            return self.num_experts, 2 * self.intermediate_dim, self.hidden_dim
        if kind == "down":
            return self.num_experts, self.hidden_dim, self.intermediate_dim
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def quantized(self, kind: str) -> mxfp4.MXFP4Tensor:
        return mxfp4.MXFP4Tensor(getattr(self, f"{kind}_packed"), getattr(self, f"{kind}_scales"),
                                 self.weight_shape(kind), self.mode)

    def dequantized(self, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """dequant(Q(W)) [E, out, in]; with cache_dequantized, computed once per (dtype, device, data)."""
        if not self.cache_dequantized:
            return self.quantized(kind).dequantize(dtype)
        p, s = getattr(self, f"{kind}_packed"), getattr(self, f"{kind}_scales")
        key = (dtype, p.device, p.data_ptr(), p._version, s.data_ptr(), s._version)
        hit = self._dense_cache.get(kind)
        if hit is None or hit[0] != key:
            hit = (key, self.quantized(kind).dequantize(dtype))
            self._dense_cache[kind] = hit
        return hit[1]

    def _expert_dequantized(self, kind: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        if self.cache_dequantized:
            return self.dequantized(kind, dtype)[e]
        out, inp = self.weight_shape(kind)[1:]
        q = mxfp4.MXFP4Tensor(getattr(self, f"{kind}_packed")[e], getattr(self, f"{kind}_scales")[e], (out, inp), self.mode)
        return q.dequantize(dtype)

    def offsets(self, kind: str) -> list[int]:
        off = [0]
        for r in self.ranks[kind]:
            off.append(off[-1] + r)
        return off

    def adapter(self, kind: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's adapter (A [out, r_e], B [r_e, in]) as views of the concatenated parameters."""
        off = self.offsets(kind)
        return (getattr(self, f"{kind}_lora_a")[:, off[e]:off[e + 1]], getattr(self, f"{kind}_lora_b")[off[e]:off[e + 1]])

    def set_adapters(self, kind: str, factors: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Set every expert's adapter of matrix `kind`: factors[e] = (A [out, r_e], B [r_e, in]) or None
        (rank 0); values rounded to adapter_dtype. ValueError for a shape or a NaN / inf."""
        _, out, inp = self.weight_shape(kind)
        if len(factors) != self.num_experts:
            raise ValueError(f"MXExperts.set_adapters({kind!r}): {len(factors)} factors for {self.num_experts} experts")
        a_parts, b_parts, ranks = [], [], []
        for e, f in enumerate(factors):
            if f is None:
                f = (torch.zeros(out, 0), torch.zeros(0, inp))
            a, b = f
            r = a.shape[1] if a.dim() == 2 else -1
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != out or tuple(b.shape) != (r, inp):
                raise ValueError(f"MXExperts {kind} adapter of expert {e}: expected A ({out}, r) and B (r, {inp}), "
                                 f"got {list(a.shape)} and {list(b.shape)}")
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                raise ValueError(f"MXExperts {kind} adapter of expert {e}: A or B holds NaN or inf")
            a_parts.append(a.detach().float().cpu())
            b_parts.append(b.detach().float().cpu())
            ranks.append(r)
        self._set_concatenated(kind, torch.cat(a_parts, 1), torch.cat(b_parts, 0), ranks)

    def _set_concatenated(self, kind: str, a: torch.Tensor, b: torch.Tensor, ranks: list[int]) -> None:
        store = ADAPTER_DTYPES[self.adapter_dtype]
        dev = self.gate_up_packed.device
        self.ranks[kind] = [int(r) for r in ranks]
        setattr(self, f"{kind}_lora_a", nn.Parameter(a.detach().to(store).to(device=dev, dtype=torch.float32).contiguous()))
        setattr(self, f"{kind}_lora_b", nn.Parameter(b.detach().to(store).to(device=dev, dtype=torch.float32).contiguous()))

    def effective_weight(self, kind: str, e: int) -> torch.Tensor:
        """dequant(Q(W_e)) + A_e B_e, float32 [out, in]: the matrix expert e applies."""
        w = self._expert_dequantized(kind, e, torch.float32)
        if self.ranks[kind][e]:
            a, b = self.adapter(kind, e)
            w = w + a @ b
        return w

    def _apply(self, kind: str, e: int, x: torch.Tensor, off: list[int]) -> torch.Tensor:
        y = F.linear(x, self._expert_dequantized(kind, e, x.dtype))
        if off[e + 1] > off[e]:
            a = getattr(self, f"{kind}_lora_a")[:, off[e]:off[e + 1]]
            b = getattr(self, f"{kind}_lora_b")[off[e]:off[e + 1]]
            y = y + F.linear(F.linear(x, b.to(x.dtype)), a.to(x.dtype))
        return y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index.long(), num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, T]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        off_gu, off_d = self.offsets("gate_up"), self.offsets("down")
        for e in hit:
            pos, tok = torch.where(mask[e])
            gate, up = self._apply("gate_up", e, hidden_states[tok], off_gu).chunk(2, dim=-1)
            y = self._apply("down", e, self.act_fn(gate) * up, off_d)
            y = y * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, y.to(final.dtype))
        return final

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for k in KINDS for p in (getattr(self, f"{k}_lora_a"), getattr(self, f"{k}_lora_b")) if p.numel()]

    def nbytes(self) -> dict[str, int]:
        """Bytes: packed codes and scales of both matrices, adapters in their storage dtype."""
        item = torch.empty((), dtype=ADAPTER_DTYPES[self.adapter_dtype]).element_size()
        return {"packed": self.gate_up_packed.numel() + self.down_packed.numel(),
                "scales": self.gate_up_scales.numel() + self.down_scales.numel(),
                "adapter": sum(p.numel() for p in self.adapter_parameters()) * item}

    def num_weights(self) -> int:
        return sum(math.prod(self.weight_shape(k)) for k in KINDS)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"mode={self.mode}, gate_up_ranks={self.ranks['gate_up']}, down_ranks={self.ranks['down']}")


# --------------------------------------------------------------------------- quantize a model

def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantizable_linears(model: nn.Module, attention: bool = True, dense: bool = True) -> list[str]:
    """Names of the linear layers (nn.Linear or MXLinear) quantize_moe quantizes besides the experts:
    attention q/k/v/o if `attention`, the MLPs of dense (router-less) decoder layers if `dense`."""
    rx = [re.compile(p) for p, on in ((ATTENTION_PATTERN, attention), (DENSE_MLP_PATTERN, dense)) if on]
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, MXLinear)) and any(r.search(n) for r in rx)]


def quantize_moe(model: nn.Module, attention: bool = True, mode: str = "floor", dense: bool = True,
                 adapter_dtype: str = "bfloat16", cache: bool = True) -> dict[str, nn.Module]:
    """In place: every MoE layer's experts -> MXExperts; if `attention`, q/k/v/o -> MXLinear; if
    `dense`, the MLP linears of dense decoder layers (Qwen3-MoE mlp_only_layers) -> MXLinear (load
    1). The routers, embeddings, lm_head and norms stay float. All-or-nothing: everything is built
    before anything is swapped. `cache`: keep dequantized weights between calls (RAM for speed).
    A MoE block with a shared expert is refused (ValueError). Returns name -> new module."""
    built: dict[str, nn.Module] = {}
    for name, block in moe_layers(model).items():
        if any(hasattr(block, a) for a in ("shared_expert", "shared_experts")):
            raise ValueError(f"{name}: MoE blocks with a shared expert are not supported by quantize_moe")
        if isinstance(block.experts, MXExperts):
            raise ValueError(f"{name}.experts is already quantized")
        built[f"{name}.experts"] = MXExperts.from_experts(block.experts, mode, adapter_dtype, name=f"{name}.experts")
    names = [n for n in quantizable_linears(model, attention, dense) if isinstance(model.get_submodule(n), nn.Linear)]
    linears = {}
    if names:
        pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
        linears = quantize_model(model, pattern, mode=mode, adapter_dtype=adapter_dtype)
    for name, module in built.items():
        _set_module(model, name, module)
    cache_moe_dequantized(model, cache)
    return {**built, **linears}


def cache_moe_dequantized(model: nn.Module, on: bool = True) -> int:
    """Let every MXExperts and MXLinear keep its dequantized weights between calls. Returns the count."""
    n = 0
    for m in model.modules():
        if isinstance(m, (MXExperts, MXLinear)):
            m.cache_dequantized = on
            if not on:
                m._dense_cache = {} if isinstance(m, MXExperts) else None
            n += 1
    return n


def round_adapters(model: nn.Module) -> None:
    """Round every adapter (MXExperts and MXLinear) to its storage dtype, in place (after training,
    so the in-memory model equals what save_quantized_moe writes)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (MXExperts, MXLinear)):
                store = ADAPTER_DTYPES[m.adapter_dtype]
                for p in m.parameters(recurse=False):
                    p.copy_(p.to(store).to(p.dtype))


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
    experts: dict[str, ExpertStats]                       # experts module name -> its stats
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
        stats[f"{name}.experts"] = ExpertStats([lowrank.InputStats() for _ in range(e)],
                                               [lowrank.InputStats() for _ in range(e)], [0] * e)
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
        with forward_hooks(expert_pairs, pre=True, with_kwargs=True), forward_hooks(linear_pairs, pre=True), \
                (replay(model, routes) if routes is not None else contextlib.nullcontext()):
            for batch in batches:
                forward_batch(model, batch)
    finally:
        model.train(was_training)
    if not any(s.tokens for s in stats.values()):
        raise ValueError("expert_stats: no calibration token reached the experts (empty batches?)")
    return MoEStats(stats, lin_stats)


# --------------------------------------------------------------------------- errors, ranks, adapters

def moe_plan(float_model: nn.Module, stats: MoEStats, mode: str = "floor", scaling: str = "qera",
             attention: bool = True, dense: bool = True) -> CompensationPlan:
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
                raise ValueError(f"moe_plan: statistics of {name} are for {len(side)} experts, the model has {weights.shape[0]}")
            for e in range(weights.shape[0]):
                w = weights[e]
                err = w - mxfp4.dequantize(mxfp4.quantize(w, mode=mode, pad=True))
                s = None if scaling == "plain" or side[e].count == 0 else side[e].scale(scaling)
                key = f"{name}.{kind}_proj.{e}"
                layers[key] = LayerError(key, tuple(w.shape), lowrank.factorize(err, s), float(st.loads[e]))
    for n in quantizable_linears(float_model, attention, dense):
        lin = float_model.get_submodule(n)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"moe_plan: {n} is {type(lin).__name__}; pass the float model")
        if scaling != "plain" and (n not in stats.linears or stats.linears[n].count == 0):
            raise ValueError(f"moe_plan: scaling {scaling!r} needs calibration statistics of {n!r} (expert_stats(linears=True))")
        w = lin.weight.detach().float()
        err = w - mxfp4.dequantize(mxfp4.quantize(w, mode=mode))
        s = None if scaling == "plain" else stats.linears[n].scale(scaling)
        layers[n] = LayerError(n, tuple(w.shape), lowrank.factorize(err, s), 1.0)
    return CompensationPlan(layers, mode, scaling, "routed")


def plan_ranks(plan: CompensationPlan | Mapping[str, LayerError], budget: int,
               allocation: str = "load_aware") -> dict[str, int]:
    """key -> rank, summing to `budget`: "load_aware" gives rank units by the largest marginal gain
    load * sigma^2 (allocate_ranks, optimal for the load-weighted discarded energy), "uniform"
    spreads the same budget evenly (uniform_ranks). ValueError for an unknown allocation or a
    budget that is not an int in [0, total rank]."""
    layers = plan.layers if isinstance(plan, CompensationPlan) else dict(plan)
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    total = sum(lay.max_rank for lay in layers.values())
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or not 0 <= budget <= total:
        raise ValueError(f"rank budget must be an int in [0, {total}] (the summed rank of the {len(layers)} "
                         f"matrices), got {budget!r}")
    names = list(layers)
    if allocation == "uniform":
        r = lowrank.uniform_ranks([layers[n].max_rank for n in names], int(budget))
    else:
        r = lowrank.allocate_ranks([layers[n].spectrum for n in names], [layers[n].load for n in names], int(budget))
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
            raise ValueError(f"compensate_moe: the quantized model has no module {target!r} (plan key {key!r})") from None
        want = MXExperts if m else MXLinear
        if not isinstance(module, want):
            raise ValueError(f"compensate_moe: {target!r} is {type(module).__name__}, expected {want.__name__}; "
                             f"run quantize_moe first")
        if module.mode != plan.mode:
            raise ValueError(f"compensate_moe: {target!r} is quantized in mode {module.mode!r}, the plan in {plan.mode!r}")
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


# --------------------------------------------------------------------------- size

def moe_nbytes(model: nn.Module) -> dict:
    """Bytes by kind: expert_weights / linear_weights (MXFP4 codes + scales), expert_adapters /
    linear_adapters (their storage dtype), float (every other parameter and persistent buffer, tied
    tensors once), total; bits_per_weight: experts and linears (codes + scales, 4.25 when the input
    dims are multiples of 32), the same with their adapters, and the whole model (total bytes over
    its float parameter count)."""
    out = {"expert_weights": 0, "expert_adapters": 0, "linear_weights": 0, "linear_adapters": 0, "float": 0}
    n_expert, n_linear, n_float = 0, 0, 0
    owned = set()
    for name, m in model.named_modules():
        if isinstance(m, MXExperts):
            b = m.nbytes()
            out["expert_weights"] += b["packed"] + b["scales"]
            out["expert_adapters"] += b["adapter"]
            n_expert += m.num_weights()
            owned.add(name)
        elif isinstance(m, MXLinear):
            b = m.nbytes()
            out["linear_weights"] += b["packed"] + b["scales"]
            out["linear_adapters"] += b["adapter"]
            out["float"] += b["bias"]
            n_linear += m.in_features * m.out_features
            n_float += 0 if m.bias is None else m.bias.numel()
            owned.add(name)
    seen = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if key.rpartition(".")[0] in owned or t is None:
            continue
        ptr = (t.data_ptr(), t.numel(), t.dtype)
        if t.numel() and ptr in seen:
            continue
        seen.add(ptr)
        out["float"] += t.numel() * t.element_size()
        n_float += t.numel()
    out["total"] = sum(out.values())
    bits = lambda nbytes, n: 8.0 * nbytes / n if n else 0.0  # noqa: E731
    out["bits_per_weight"] = {
        "experts": bits(out["expert_weights"], n_expert),
        "experts_with_adapters": bits(out["expert_weights"] + out["expert_adapters"], n_expert),
        "linears": bits(out["linear_weights"], n_linear),
        "linears_with_adapters": bits(out["linear_weights"] + out["linear_adapters"], n_linear),
        "model": bits(out["total"], n_expert + n_linear + n_float)}
    return out


# --------------------------------------------------------------------------- file

def _adapter_dtype(model: nn.Module) -> str:
    found = {m.adapter_dtype for m in model.modules() if isinstance(m, (MXExperts, MXLinear))}
    if not found:
        raise ValueError("the model has no MXExperts; quantize it first (quantize_moe)")
    if len(found) > 1:
        raise ValueError(f"the quantized modules use several adapter dtypes {sorted(found)}; one file holds one")
    return found.pop()


def save_quantized_moe(model: nn.Module, path: Path | str | None = None,
                       metadata: dict[str, str] | None = None) -> bytes:
    """The quantized MoE as safetensors bytes (deterministic; also written to `path` if given); the
    format is in the module docstring. Dequantized caches are never written."""
    from crucible.serialize import safetensors_bytes

    adapter_dtype = _adapter_dtype(model)
    store = ADAPTER_DTYPES[adapter_dtype]
    experts = {n: m for n, m in model.named_modules() if isinstance(m, MXExperts)}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, MXLinear)}
    if not experts:
        raise ValueError("the model has no MXExperts; quantize it first (quantize_moe)")
    tensors, tied, first = {}, {}, {}
    for key, t in model.state_dict().items():
        if t is None:
            continue
        owner, _, leaf = key.rpartition(".")
        if "lora_" in leaf and (owner in experts or owner in linears):
            if t.numel():
                tensors[key] = t.detach().to(store).contiguous()
            continue
        ptr = (t.data_ptr(), t.numel(), t.dtype, tuple(t.shape))
        if t.numel() and ptr in first:
            tied[key] = first[ptr]
            continue
        first[ptr] = key
        tensors[key] = t.detach().contiguous()
    info = {"experts": {n: {"num_experts": m.num_experts, "hidden": m.hidden_dim, "intermediate": m.intermediate_dim,
                            "mode": m.mode, "gate_up_ranks": m.ranks["gate_up"], "down_ranks": m.ranks["down"]}
                        for n, m in experts.items()},
            "linears": {n: {"in": m.in_features, "out": m.out_features, "mode": m.mode, "rank": m.rank}
                        for n, m in linears.items()},
            "adapter_dtype": adapter_dtype, "tied": tied}
    data = safetensors_bytes(tensors, {**(metadata or {}), "format": "pt", "crucible.moe": json.dumps(info, sort_keys=True)})
    if path is not None:
        Path(path).write_bytes(data)
    return data


def _check(key: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None, path) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{path}: tensor '{key}' is {t.dtype} {list(t.shape)} in the file, the architecture needs "
                         f"{dtype or t.dtype} {list(shape)} (a file of another model?)")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{path}: tensor '{key}' holds NaN or inf")
    if dtype == torch.uint8 and key.endswith("scales") and bool((t == mxfp4.E8M0_NAN).any()):
        raise ValueError(f"{path}: tensor '{key}' holds the NaN scale byte 255")
    return t


def _take(tensors: dict, key: str, shape: tuple, dtype: torch.dtype | None, path) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"{path}: tensor '{key}' is missing")
    return _check(key, tensors.pop(key), shape, dtype, path)


def load_quantized_moe(path: Path | str, skeleton: nn.Module) -> nn.Module:
    """Rebuild a model saved by save_quantized_moe into `skeleton` (the float architecture, any
    weights): its experts become MXExperts and its quantized linears MXLinear from the packed tensors, every
    other tensor is loaded strictly; returned in eval mode. ValueError naming the file and the
    tensor for a truncated or foreign file, a missing or extra tensor, a shape that does not fit,
    NaN / inf values or NaN scales. All-or-nothing: the skeleton is changed only on success."""
    tensors, meta = read_safetensors(path)
    if "crucible.moe" not in meta:
        raise ValueError(f"{path}: no 'crucible.moe' metadata; not a quantized MoE written by save_quantized_moe")
    info = json.loads(meta["crucible.moe"])
    adapter_dtype = info["adapter_dtype"]
    store = ADAPTER_DTYPES[adapter_dtype]
    blocks = {f"{n}.experts": b for n, b in moe_layers(skeleton).items()}
    built: dict[str, nn.Module] = {}
    for name, spec in info["experts"].items():
        if name not in blocks:
            raise ValueError(f"{path}: quantized experts {name!r} are not a MoE layer of the architecture "
                             f"(it has {list(blocks)[:3]})")
        old = blocks[name].experts
        e, two_i, h = old.gate_up_proj.shape
        i = two_i // 2
        module_args = {}
        for kind, (out, inp) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            kp = _padded(inp)
            module_args[f"{kind}_packed"] = _take(tensors, f"{name}.{kind}_packed", (e, out, kp // 2), torch.uint8, path)
            module_args[f"{kind}_scales"] = _take(tensors, f"{name}.{kind}_scales", (e, out, kp // 32), torch.uint8, path)
        try:
            module = MXExperts(e, h, i, act_fn=old.act_fn, mode=spec["mode"], adapter_dtype=adapter_dtype, **module_args)
        except ValueError as exc:
            raise ValueError(f"{path}: experts {name!r}: {exc}") from None
        for kind, (out, inp) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            ranks = [int(r) for r in spec[f"{kind}_ranks"]]
            if len(ranks) != e or any(r < 0 or r > min(out, inp) for r in ranks):
                raise ValueError(f"{path}: experts {name!r}: {kind}_ranks {ranks} do not fit {e} experts of "
                                 f"{out} x {inp}")
            total = sum(ranks)
            if total:
                a = _take(tensors, f"{name}.{kind}_lora_a", (out, total), store, path)
                b = _take(tensors, f"{name}.{kind}_lora_b", (total, inp), store, path)
                module._set_concatenated(kind, a.float(), b.float(), ranks)
        built[name] = module
    for name, spec in info["linears"].items():
        try:
            old = skeleton.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{path}: quantized layer {name!r} does not exist in the architecture") from None
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{path}: quantized layer {name!r} is {type(old).__name__} in the architecture, not nn.Linear")
        out, inp = old.out_features, old.in_features
        packed = _take(tensors, f"{name}.packed", (out, _padded(inp) // 2), torch.uint8, path)
        scales = _take(tensors, f"{name}.scales", (out, _padded(inp) // 32), torch.uint8, path)
        bias = _take(tensors, f"{name}.bias", (out,), None, path) if old.bias is not None else None
        try:
            layer = MXLinear(inp, out, packed, scales, bias, mode=spec["mode"], adapter_dtype=adapter_dtype)
        except ValueError as exc:
            raise ValueError(f"{path}: layer {name!r}: {exc}") from None
        r = int(spec["rank"])
        if r:
            layer.set_adapter(_take(tensors, f"{name}.lora_a", (out, r), store, path).float(),
                              _take(tensors, f"{name}.lora_b", (r, inp), store, path).float())
        built[name] = layer
    state = skeleton.state_dict()
    tied = info.get("tied", {})
    expected = {k: v for k, v in state.items() if k.rpartition(".")[0] not in built and k not in tied}
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{path}: tensor '{extra[0]}' does not belong to the architecture (unexpected: {extra[:5]})")
    for k, v in expected.items():
        if k not in tensors:
            raise ValueError(f"{path}: tensor '{k}' is missing")
        _check(k, tensors[k], tuple(v.shape), None, path)
    for name, module in built.items():
        _set_module(skeleton, name, module)
    rest = {k: tensors[k] for k in expected}
    rest.update({k: tensors[src] for k, src in tied.items() if src in tensors})
    skeleton.load_state_dict(rest, strict=False)
    return skeleton.eval()
