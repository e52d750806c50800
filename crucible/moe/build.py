"""MoEfication: a dense Llama-architecture causal LM -> a transformers Mixtral MoE (docs/methods.md,
moe; docs/architecture.md, "Models").

    moe, report = moefy(dense, calib_input_ids, n_experts=8, top_k=2, seed=0)
    report.frame()                       # per layer: router recall, mass covered, fit R^2, loads
    with all_experts_unit_weight(moe):   # every expert selected, unscaled: the dense model exactly
        assert torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-5)
    save_moe(moe, folder, tokenizer, report)

Method (MoEfication, Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of
Experts", Findings of ACL 2022; the split of LLaMA's gated FFN as in LLaMA-MoE, Zhu et al. 2024):
- A gated FFN is a sum over its neurons j: y = sum_j a_j(x) d_j with a_j = silu(g_j . x)(u_j . x)
  and d_j the j-th column of down_proj. Splitting the neurons into E groups of I/E splits y into E
  expert outputs exactly; expert e holds the rows g_e of gate_proj and up_proj (fused as
  gate_up_proj[e] = [gate rows; up rows], [2 I/E, H]) and the columns g_e of down_proj
  (down_proj[e], [H, I/E]).
- Groups (`balanced_groups`, crucible.moe.moefy_fit): neurons that fire on the same tokens belong
  together, so that a token needs few experts; balanced spherical k-means gives every expert exactly
  I/E neurons. Layer i is clustered with seed derive_seed(seed, "moefy", i).
- Router (`fit_router`, crucible.moe.moefy_fit): a ridge least-squares map from the FFN input to
  the groups' shares of the activation mass becomes `mlp.gate.weight` [E, H].
- Combine weights: Mixtral renormalises the top-k softmax weights to sum to 1, so a token's FFN
  output is sum_{e in top-k} w_e y_e with sum w_e = 1, about 1/k of the sum of its selected
  groups. `expert_scale` (default top_k) multiplies every expert's down_proj so that nearly equal
  weights give back the plain sum of the selected groups, as MoEfication sums its selected experts.
  The scale is recorded in the config (`moefy_expert_scale`); `all_experts_unit_weight` undoes it.
- Everything else (embeddings, attention, norms, lm_head, rope, eps, tying) is copied exactly:
  Mixtral's attention equals Llama's without bias and with sliding_window=None.

Report, per layer: `recall` = the mean share of the oracle top-k groups (by mass) that the router's
top-k recovers (chance: k/E); `mass_covered` / `oracle_mass` = the mean share of the token's total
mass in the router's / the oracle's top-k groups; `r2` of the share fit; `load` = the share of
routed (token, slot) pairs each expert receives. All on the calibration tokens.

Contract
- moefy(dense, calib_input_ids, n_experts=8, top_k=2, seed=0, expert_scale=None, ridge=1e-3,
  iters=30, batch_size=8, progress=False) -> (MixtralForCausalLM in eval mode, in dense's dtype,
  MoefyReport). dense: a LlamaForCausalLM (model_type "llama", no attention or MLP bias, finite
  weights). calib_input_ids: an integer tensor [N, T], ids in [0, vocab_size), no padding.
  ValueError, naming the parameter and the value, for: n_experts not an int >= 1 or not dividing
  intermediate_size; top_k not an int in [1, n_experts]; expert_scale not finite > 0; ridge < 0;
  calib_input_ids not a 2-D integer tensor, empty, or out of range; a non-Llama dense model; a
  NaN/inf weight (naming the parameter). Deterministic given seed and inputs.
- balanced_groups, group_mass, fit_router, router_quality: crucible.moe.moefy_fit.
- all_experts_unit_weight(model): context manager; every MoE block's router (`mlp.gate`, a module
  next to `mlp.experts`) selects all E experts, each at weight 1 / moefy_expert_scale (1 when the
  config has none), so each expert contributes its unscaled FFN slice at unit weight.
  ValueError when the model has no MoE block.
- save_moe(model, folder, tokenizer=None, report=None) -> Path: safetensors via save_pretrained,
  the tokenizer, and the report as moefy_report.json; loads with AutoModelForCausalLM.from_pretrained.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from crucible.hooks import forward_hooks
from crucible.moe.moefy_fit import _int_param, balanced_groups, fit_router, group_mass, router_quality
from crucible.seeding import derive_seed

__all__ = ["LayerReport", "MoefyReport", "moefy", "capture_ffn", "all_experts_unit_weight", "save_moe"]


@dataclass
class LayerReport:
    groups: list[list[int]]  # [E][I/E] dense neuron indices of each expert
    recall: float
    mass_covered: float
    oracle_mass: float
    r2: float
    load: list[float]  # [E], sums to 1


@dataclass
class MoefyReport:
    n_experts: int
    top_k: int
    expert_scale: float
    seed: int
    n_tokens: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # capture, cluster, router, build

    def to_dict(self) -> dict:
        return asdict(self)

    def frame(self):
        """One row per layer: recall, mass_covered, oracle_mass, r2, load_min, load_max."""
        import pandas as pd

        return pd.DataFrame([{"layer": i, "recall": r.recall, "mass_covered": r.mass_covered,
                              "oracle_mass": r.oracle_mass, "r2": r.r2, "load_min": min(r.load),
                              "load_max": max(r.load)} for i, r in enumerate(self.layers)])


# --------------------------------------------------------------------------- validation

def _check_dense(dense: nn.Module) -> None:
    cfg = getattr(dense, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type != "llama" or not hasattr(getattr(dense, "model", None), "layers"):
        why = {"qwen2": "its q/k/v projections carry biases, which Mixtral's attention has not",
               "mistral": "its sliding-window attention is not carried over to the Mixtral build",
               "gpt2": "its blocks use Conv1D and an ungated FFN, not gate/up/down projections"}.get(
            model_type, "only a gated Llama FFN (gate_proj, up_proj, down_proj) with Llama attention is split")
        raise ValueError(f"moefy: dense model_type={model_type!r} ({type(dense).__name__}) is not supported: {why}; "
                         "the MoE branch accepts Llama-architecture LlamaForCausalLM models (SmolLM2, Llama 2/3, "
                         "TinyLlama) without attention or MLP biases")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise ValueError(f"moefy: dense config {flag}=True is not supported; Mixtral has no biases")
    for name, p in dense.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise ValueError(f"moefy: dense parameter {name} holds {bad} NaN/inf entries; the weights must be finite")


def _check_ids(ids, vocab_size: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"moefy: calib_input_ids must be a torch.Tensor [N, T], got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"moefy: calib_input_ids dtype={ids.dtype} must be an integer dtype (token ids)")
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"moefy: calib_input_ids shape={list(ids.shape)} must be [N, T] with N, T >= 1")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"moefy: calib_input_ids range [{lo}, {hi}] must lie in [0, vocab_size={vocab_size})")
    return ids.long()


# --------------------------------------------------------------------------- the steps

@torch.no_grad()
def capture_ffn(dense: nn.Module, input_ids: torch.Tensor, batch_size: int = 8,
                progress: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (X [T, H] the FFN input, A [T, I] the activations silu(gate x) * up x) over all
    N * T calibration tokens, float32 on the CPU, captured with forward pre-hooks."""
    layers = dense.model.layers
    xs, acts = [[] for _ in layers], [[] for _ in layers]
    pairs = []
    for i, layer in enumerate(layers):
        pairs.append((layer.mlp,
                      lambda m, args, i=i: xs[i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())))
        pairs.append((layer.mlp.down_proj,
                      lambda m, args, i=i: acts[i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu())))
    was_training = dense.training
    dense.eval()
    device = next(dense.parameters()).device
    starts = range(0, input_ids.shape[0], batch_size)
    if progress:
        from crucible.progress import Progress

        starts = Progress(starts, desc="moefy: capture", unit="batch")
    try:
        with forward_hooks(pairs, pre=True):
            for s in starts:
                dense.model(input_ids=input_ids[s:s + batch_size].to(device), use_cache=False)  # lm_head not needed
    finally:
        dense.train(was_training)
    return [(torch.cat(x), torch.cat(a)) for x, a in zip(xs, acts)]


def _mixtral_config(cfg, n_experts: int, top_k: int, expert_scale: float):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size // n_experts, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range, rms_norm_eps=cfg.rms_norm_eps, use_cache=cfg.use_cache,
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings, sliding_window=None,
        attention_dropout=cfg.attention_dropout, num_experts_per_tok=top_k, num_local_experts=n_experts,
        router_jitter_noise=0.0, rope_parameters=copy.deepcopy(cfg.rope_parameters),
        moefy_expert_scale=float(expert_scale))


def moefy(dense: nn.Module, calib_input_ids: torch.Tensor, n_experts: int = 8, top_k: int = 2, seed: int = 0,
          expert_scale: float | None = None, ridge: float = 1e-3, iters: int = 30, batch_size: int = 8,
          progress: bool = False):
    """Split every FFN of a dense Llama model into `n_experts` experts and fit routers: a Mixtral
    MoE and its MoefyReport (see the module docstring)."""
    from transformers import MixtralForCausalLM
    from transformers.initialization import no_init_weights

    _check_dense(dense)
    cfg = dense.config
    n_experts = _int_param(n_experts, "n_experts", 1)
    if cfg.intermediate_size % n_experts:
        raise ValueError(f"moefy: n_experts={n_experts} must divide intermediate_size={cfg.intermediate_size}")
    top_k = _int_param(top_k, "top_k", 1, n_experts)
    _int_param(seed, "seed", 0)
    _int_param(iters, "iters", 1)
    _int_param(batch_size, "batch_size", 1)
    scale = float(top_k if expert_scale is None else expert_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"moefy: expert_scale={expert_scale!r} must be finite and > 0 (None: top_k)")
    if not (isinstance(ridge, numbers.Real) and math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"moefy: ridge={ridge!r} must be finite and >= 0")
    ids = _check_ids(calib_input_ids, cfg.vocab_size)

    report = MoefyReport(n_experts=n_experts, top_k=top_k, expert_scale=scale, seed=int(seed), n_tokens=ids.numel())
    t0 = time.perf_counter()
    captured = capture_ffn(dense, ids, batch_size, progress)
    report.seconds["capture"] = time.perf_counter() - t0

    layer_iter = enumerate(captured)
    if progress:
        from crucible.progress import Progress

        layer_iter = Progress(layer_iter, total=len(captured), desc="moefy: layers", unit="layer")
    expert_weights, cluster_s, router_s = [], 0.0, 0.0
    for i, (x, a) in layer_iter:
        t0 = time.perf_counter()
        groups = balanced_groups(a, n_experts, seed=derive_seed(int(seed), "moefy", i), iters=iters)
        cluster_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        mass = group_mass(a, groups)
        weight = fit_router(x, mass, ridge)
        quality = router_quality(x, mass, weight, top_k)
        router_s += time.perf_counter() - t0
        report.layers.append(LayerReport(groups=groups.tolist(), **quality))
        expert_weights.append((groups, weight))
    captured.clear()
    report.seconds["cluster"], report.seconds["router"] = cluster_s, router_s

    t0 = time.perf_counter()
    dtype = next(dense.parameters()).dtype
    with no_init_weights():  # every parameter is loaded below
        moe = MixtralForCausalLM(_mixtral_config(cfg, n_experts, top_k, scale))
    moe.to(dtype=dtype, device=next(dense.parameters()).device)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    for i, (groups, weight) in enumerate(expert_weights):
        mlp = dense.model.layers[i].mlp
        prefix = f"model.layers.{i}.mlp."
        state[prefix + "experts.gate_up_proj"] = torch.cat(
            [mlp.gate_proj.weight[groups], mlp.up_proj.weight[groups]], dim=1)            # [E, 2s, H]
        state[prefix + "experts.down_proj"] = mlp.down_proj.weight[:, groups].permute(1, 0, 2) * scale  # [E, H, s]
        state[prefix + "gate.weight"] = weight.to(dtype)
    moe.load_state_dict(state, strict=True)
    from crucible.moe.dense import tie_embeddings

    tie_embeddings(moe)
    dense_rope, moe_rope = dense.model.rotary_emb, moe.model.rotary_emb
    if not (torch.equal(dense_rope.inv_freq, moe_rope.inv_freq)
            and dense_rope.attention_scaling == moe_rope.attention_scaling):
        raise RuntimeError(f"moefy: the Mixtral rotary embedding differs from the dense one "
                           f"(rope_parameters={cfg.rope_parameters})")
    report.seconds["build"] = time.perf_counter() - t0
    return moe.eval(), report


# --------------------------------------------------------------------------- use and save

@contextmanager
def all_experts_unit_weight(model: nn.Module):
    """Within the block every router selects all experts, each at weight 1 / moefy_expert_scale,
    so the MoE computes the dense FFN it was split from."""
    weight = 1.0 / float(getattr(model.config, "moefy_expert_scale", None) or 1.0)

    def every_expert(router, args, output):
        logits, scores = output[0], output[1]
        n_tokens, n_experts = logits.shape[0], logits.shape[-1]
        index = torch.arange(n_experts, device=logits.device).repeat(n_tokens, 1)
        return logits, torch.full((n_tokens, n_experts), weight, dtype=scores.dtype, device=scores.device), index

    routers = [m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module) and hasattr(m, "experts")]
    if not routers:
        raise ValueError(f"all_experts_unit_weight: {type(model).__name__} has no MoE block (a module with "
                         "`gate` and `experts`)")
    with forward_hooks([(router, every_expert) for router in routers]):
        yield model


def save_moe(model: nn.Module, folder: str | Path, tokenizer=None, report: MoefyReport | None = None) -> Path:
    """save_pretrained (safetensors), the tokenizer and moefy_report.json into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if report is not None:
        (folder / "moefy_report.json").write_text(json.dumps(report.to_dict(), indent=1))
    return folder
