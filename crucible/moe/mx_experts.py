"""MXFP4 experts with per-expert low-rank adapters, and quantizing a MoE model (docs/methods.md, moe).

    quantize_moe(qmodel, attention=True, mode="floor")         # in place: MXExperts (+ MXLinear q/k/v/o)
    cache_moe_dequantized(qmodel, True)                         # keep dequantized weights between calls
    round_adapters(qmodel)                                      # adapters to their storage dtype

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
The router (`mlp.gate`), embeddings, lm_head and norms stay in float.

Adapter values are rounded to `adapter_dtype` (bfloat16 by default, as crucible's MXLinear) when
set, so a saved and reloaded model computes exactly what the in-memory one did; `round_adapters`
re-rounds after training. `cache_moe_dequantized` keeps the dequantized experts in RAM between
calls (never in the state dict or the file).

Setting the adapters from the quantization error: crucible.moe.compensate; the file and the size in
bytes: crucible.moe.mx_storage.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from crucible.moe.routing import moe_layers
from crucible.quant import mxfp4
from crucible.quant.linear import ADAPTER_DTYPES, MXLinear, quantize_model

__all__ = [
    "MXExperts",
    "quantize_moe",
    "quantizable_linears",
    "cache_moe_dequantized",
    "round_adapters",
    "ATTENTION_PATTERN",
    "DENSE_MLP_PATTERN",
    "SHARED_PATTERN",
    "KINDS",
]

KINDS = ("gate_up", "down")
ATTENTION_PATTERN = r"\.self_attn\.(q|k|v|o)_proj$"
DENSE_MLP_PATTERN = r"\.mlp\.(gate|up|down)_proj$"  # Qwen3-MoE's dense layers; a SparseMoeBlock has none
SHARED_PATTERN = r"\.mlp\.shared_experts?\.(gate|up|down)_proj$"  # Qwen2-MoE's always-on shared expert


# --------------------------------------------------------------------------- the module


class MXExperts(nn.Module):
    """Fused MoE experts in MXFP4 with per-expert low-rank adapters (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        gate_up_packed: torch.Tensor,
        gate_up_scales: torch.Tensor,
        down_packed: torch.Tensor,
        down_scales: torch.Tensor,
        act_fn: nn.Module,
        mode: str = "floor",
        adapter_dtype: str = "bfloat16",
    ):
        super().__init__()
        if adapter_dtype not in ADAPTER_DTYPES:
            raise ValueError(f"adapter_dtype must be one of {sorted(ADAPTER_DTYPES)}, got {adapter_dtype!r}")
        if mode not in mxfp4.MODES:
            raise ValueError(f"mode must be one of {mxfp4.MODES}, got {mode!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = (
            int(num_experts),
            int(hidden_dim),
            int(intermediate_dim),
        )
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
    def from_experts(
        cls, experts: nn.Module, mode: str = "floor", adapter_dtype: str = "bfloat16", name: str = "experts"
    ) -> "MXExperts":
        """Quantize transformers' fused experts. ValueError naming `name` for a non-finite weight or a
        layout other than concatenated [gate; up], untransposed, without bias."""
        for attr, ok in (("has_bias", False), ("is_transposed", False), ("has_gate", True), ("is_concatenated", True)):
            if getattr(experts, attr, ok) != ok:
                raise ValueError(
                    f"{name}: experts with {attr}={getattr(experts, attr)} are not supported (MXExperts "
                    f"holds gate_up_proj [E, 2I, H] as [gate; up] and down_proj [E, H, I], no bias)"
                )
        gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3):
            raise ValueError(
                f"{name}: expected 3-D gate_up_proj and down_proj parameters, got {type(experts).__name__}"
            )
        e, two_i, h = gu.shape
        if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
            raise ValueError(
                f"{name}: gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} do not fit "
                f"[E, 2I, H] and [E, H, I]"
            )
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
        return mxfp4.MXFP4Tensor(
            getattr(self, f"{kind}_packed"), getattr(self, f"{kind}_scales"), self.weight_shape(kind), self.mode
        )

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
        q = mxfp4.MXFP4Tensor(
            getattr(self, f"{kind}_packed")[e], getattr(self, f"{kind}_scales")[e], (out, inp), self.mode
        )
        return q.dequantize(dtype)

    def offsets(self, kind: str) -> list[int]:
        off = [0]
        for r in self.ranks[kind]:
            off.append(off[-1] + r)
        return off

    def adapter(self, kind: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's adapter (A [out, r_e], B [r_e, in]) as views of the concatenated parameters."""
        off = self.offsets(kind)
        return (
            getattr(self, f"{kind}_lora_a")[:, off[e] : off[e + 1]],
            getattr(self, f"{kind}_lora_b")[off[e] : off[e + 1]],
        )

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
                raise ValueError(
                    f"MXExperts {kind} adapter of expert {e}: expected A ({out}, r) and B (r, {inp}), "
                    f"got {list(a.shape)} and {list(b.shape)}"
                )
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
        setattr(
            self, f"{kind}_lora_a", nn.Parameter(a.detach().to(store).to(device=dev, dtype=torch.float32).contiguous())
        )
        setattr(
            self, f"{kind}_lora_b", nn.Parameter(b.detach().to(store).to(device=dev, dtype=torch.float32).contiguous())
        )

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
            a = getattr(self, f"{kind}_lora_a")[:, off[e] : off[e + 1]]
            b = getattr(self, f"{kind}_lora_b")[off[e] : off[e + 1]]
            y = y + F.linear(F.linear(x, b.to(x.dtype)), a.to(x.dtype))
        return y

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
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
        return {
            "packed": self.gate_up_packed.numel() + self.down_packed.numel(),
            "scales": self.gate_up_scales.numel() + self.down_scales.numel(),
            "adapter": sum(p.numel() for p in self.adapter_parameters()) * item,
        }

    def num_weights(self) -> int:
        return sum(math.prod(self.weight_shape(k)) for k in KINDS)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"mode={self.mode}, gate_up_ranks={self.ranks['gate_up']}, down_ranks={self.ranks['down']}"
        )


# --------------------------------------------------------------------------- quantize a model


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantizable_linears(model: nn.Module, attention: bool = True, dense: bool = True, shared: bool = True) -> list[str]:
    """Names of the linear layers (nn.Linear or MXLinear) quantize_moe quantizes besides the experts:
    attention q/k/v/o if `attention`, the MLPs of dense (router-less) decoder layers if `dense`, the
    shared expert's gate/up/down if `shared` (its sigmoid gate, like the router, stays float)."""
    rx = [
        re.compile(p)
        for p, on in ((ATTENTION_PATTERN, attention), (DENSE_MLP_PATTERN, dense), (SHARED_PATTERN, shared))
        if on
    ]
    return [
        n for n, m in model.named_modules() if isinstance(m, (nn.Linear, MXLinear)) and any(r.search(n) for r in rx)
    ]


def quantize_moe(
    model: nn.Module,
    attention: bool = True,
    mode: str = "floor",
    dense: bool = True,
    adapter_dtype: str = "bfloat16",
    cache: bool = True,
    shared: bool = True,
) -> dict[str, nn.Module]:
    """In place: every MoE layer's experts -> MXExperts; if `attention`, q/k/v/o -> MXLinear; if
    `dense`, the MLP linears of dense decoder layers (Qwen3-MoE mlp_only_layers) -> MXLinear (load
    1). The routers, embeddings, lm_head and norms stay float. All-or-nothing: everything is built
    before anything is swapped. `cache`: keep dequantized weights between calls (RAM for speed).
    `shared`: a shared expert's linears (Qwen2-MoE) -> MXLinear too; off, they stay float. Returns
    name -> new module."""
    built: dict[str, nn.Module] = {}
    for name, block in moe_layers(model).items():
        if isinstance(block.experts, MXExperts):
            raise ValueError(f"{name}.experts is already quantized")
        built[f"{name}.experts"] = MXExperts.from_experts(block.experts, mode, adapter_dtype, name=f"{name}.experts")
    names = [
        n for n in quantizable_linears(model, attention, dense, shared) if isinstance(model.get_submodule(n), nn.Linear)
    ]
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
