"""MoEfication with shared experts: a dense Llama / Qwen2 causal LM -> a transformers Qwen2-MoE
(docs/methods.md, moe; docs/architecture.md, "Models").

    moe, report = moefy(dense, calib_input_ids, n_experts=6, top_k=2, shared_share=0.25, seed=0)
    report.frame()                       # per layer: shared mass, router recall, mass covered, loads
    with all_experts_unit_weight(moe):   # every expert selected, unscaled: the dense model exactly
        assert torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-5)
    set_top_k(moe, 4)                    # the same experts, more of them per token
    save_moe(moe, folder, tokenizer, report)

Method (CMoE, Pei et al. 2025, arXiv 2502.04416; MoEfication, Zhang et al. 2022; LLaMA-MoE, Zhu et
al. 2024; the shared expert of DeepSeekMoE and Qwen2-MoE):
- A gated FFN is a sum over its neurons j: y = sum_j a_j(x) d_j with a_j = silu(g_j . x)(u_j . x)
  and d_j the j-th column of down_proj. Splitting the neurons into groups splits y exactly.
- Shared expert (`shared_neurons`, crucible.moe.moefy_fit): a SwiGLU FFN is not sparse the way a
  ReLU FFN is; a few neurons carry mass on almost every token. Per calibration token the neurons
  among its `active` largest |a_j| (active = the MoE's active width) count as firing; the
  round(shared_share * I) neurons that fire on the most tokens form the always-on shared expert.
- Routed experts (`balanced_groups`): the remaining neurons, by balanced spherical k-means of their
  |activation| profiles over the calibration tokens, into `n_experts` equal experts (layer i with
  seed derive_seed(seed, "moefy", i)).
- Router (`fit_router`): a ridge least-squares map from the FFN input to the routed groups' shares of
  the activation mass becomes `mlp.gate.weight` [E, H]; no training is needed for a usable model
  (`crucible.moe.recover` distils the routers afterwards).
- Combine weights: the router renormalises its top-k softmax weights to sum to 1
  (`norm_topk_prob`); `expert_scale` (default top_k) multiplies every routed expert's down_proj so
  that nearly equal weights give each selected expert about unit weight, as CMoE starts its experts
  and MoEfication sums them. Qwen2-MoE gates its shared expert by sigmoid(shared_expert_gate . x);
  the gate starts at zero (sigmoid 0.5) and the shared down_proj at twice the dense columns, so the
  shared expert starts at exactly unit weight. The scale is recorded in the config
  (`moefy_expert_scale`); `all_experts_unit_weight` undoes it.
- Everything else (embeddings, attention with its q/k/v biases when the dense model has them,
  norms, lm_head, rope, eps, tying) is copied exactly: Qwen2-MoE's attention is Llama's with
  `qkv_bias` off and Qwen2's with it on, without a sliding window.

Report, per layer: `shared` (the shared neurons), `shared_mass` = the mean share of the token's
|a| mass in them; over the routed neurons: `recall` = the mean share of the oracle top-k groups (by
mass) the router's top-k recovers (chance: k/E), `mass_covered` / `oracle_mass` = the mean share of
the routed mass in the router's / the oracle's top-k, `r2` of the share fit, `load` = the share of
routed (token, slot) pairs per expert; `active_mass` = the mean share of the token's whole mass in
the shared expert plus the router's top-k. All on the calibration tokens.

Contract
- moefy(dense, calib_input_ids, n_experts=8, top_k=2, shared_share=0.0, seed=0, expert_scale=None,
  ridge=1e-3, iters=30, batch_size=8, progress=False) -> (Qwen2MoeForCausalLM in eval mode, in
  dense's dtype, MoefyReport). dense: a LlamaForCausalLM or Qwen2ForCausalLM (no MLP bias, no
  sliding window, finite weights). The shared width round(shared_share * I) must leave a routed
  width that n_experts divides. calib_input_ids: an integer tensor [N, T], ids in [0, vocab_size),
  no padding. ValueError, naming the parameter and the value, for: n_experts, top_k, shared_share
  out of range or not dividing; expert_scale not finite > 0; ridge < 0; bad calib_input_ids;
  another architecture (by name); a NaN/inf weight (naming the parameter). Deterministic given seed
  and inputs.
- active_share(n_experts, top_k, shared_share) -> float: the share of the FFN a token uses.
- set_top_k(model, top_k): every router selects top_k experts from now on; the routed down_proj is
  rescaled so that moefy_expert_scale becomes top_k (when it was top_k). In place.
- all_experts_unit_weight(model): context manager; every MoE block's router (`mlp.gate`, a module
  next to `mlp.experts`) selects all E experts, each at weight 1 / moefy_expert_scale (1 when the
  config has none), so each expert contributes its unscaled FFN slice at unit weight; the shared
  expert keeps its gate (unit weight as built). ValueError when the model has no MoE block.
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

import numpy as np
import torch
from torch import nn

from crucible.hooks import forward_hooks
from crucible.moe.moefy_fit import _int_param, balanced_groups, fit_router, group_mass, router_quality
from crucible.seeding import derive_seed

__all__ = [
    "LayerReport",
    "MoefyReport",
    "SUPPORTED",
    "moefy",
    "active_share",
    "set_top_k",
    "capture_ffn",
    "all_experts_unit_weight",
    "save_moe",
]


@dataclass
class LayerReport:
    groups: list[list[int]]  # [E][routed width / E] dense neuron indices of each routed expert
    shared: list[int]  # the shared expert's dense neuron indices (ascending)
    shared_mass: float
    active_mass: float
    recall: float
    mass_covered: float
    oracle_mass: float
    r2: float
    load: list[float]  # [E], sums to 1


@dataclass
class MoefyReport:
    n_experts: int
    top_k: int
    shared_share: float
    expert_scale: float
    seed: int
    n_tokens: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # capture, cluster, router, build

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def active_share(self) -> float:
        return active_share(self.n_experts, self.top_k, self.shared_share)

    def frame(self):
        """One row per layer: shared_mass, active_mass, recall, mass_covered, oracle_mass, r2, load_min, load_max."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "layer": i,
                    "shared_mass": r.shared_mass,
                    "active_mass": r.active_mass,
                    "recall": r.recall,
                    "mass_covered": r.mass_covered,
                    "oracle_mass": r.oracle_mass,
                    "r2": r.r2,
                    "load_min": min(r.load),
                    "load_max": max(r.load),
                }
                for i, r in enumerate(self.layers)
            ]
        )


def active_share(n_experts: int, top_k: int, shared_share: float) -> float:
    """The share of the FFN's neurons one token uses: the shared expert plus top_k routed experts."""
    return float(shared_share) + (1.0 - float(shared_share)) * top_k / n_experts


# --------------------------------------------------------------------------- validation

SUPPORTED = ("llama", "qwen2", "mistral")


def _check_dense(dense: nn.Module) -> None:
    cfg = getattr(dense, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED or not hasattr(getattr(dense, "model", None), "layers"):
        why = {
            "gpt2": "its blocks use Conv1D and an ungated FFN, not gate/up/down projections",
            "phi": "its FFN is ungated (fc1, fc2)",
            "gemma": "its attention and norms differ from Llama's",
        }.get(model_type, "only a gated FFN (gate_proj, up_proj, down_proj) under Llama / Qwen2 attention is split")
        raise ValueError(
            f"moefy: dense model_type={model_type!r} ({type(dense).__name__}) is not supported: {why}; "
            f"the MoE branch accepts {', '.join(SUPPORTED)} causal LMs (SmolLM2, Llama 2/3, TinyLlama, "
            "Qwen2 / Qwen2.5, Mistral without a sliding window)"
        )
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("moefy: dense config mlp_bias=True is not supported; Qwen2-MoE's experts have no biases")
    if model_type != "qwen2" and getattr(cfg, "attention_bias", False):
        raise ValueError(
            "moefy: dense config attention_bias=True is not supported (it biases o_proj too); "
            "Qwen2-MoE's attention biases q/k/v only"
        )
    window = (
        getattr(cfg, "sliding_window", None)
        if model_type == "mistral"
        else (getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", False) else None)
    )
    if window:
        raise ValueError(
            f"moefy: dense config sliding_window={window} is not supported; the MoE attends over the "
            "whole sequence (set sliding_window to None / use_sliding_window to False if the model "
            "was trained without it)"
        )
    for name, p in dense.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise ValueError(f"moefy: dense parameter {name} holds {bad} NaN/inf entries; the weights must be finite")


def _qkv_bias(dense: nn.Module) -> bool:
    return dense.config.model_type == "qwen2" or bool(getattr(dense.config, "attention_bias", False))


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
def capture_ffn(
    dense: nn.Module, input_ids: torch.Tensor, batch_size: int = 8, progress: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (X [T, H] the FFN input, A [T, I] the activations silu(gate x) * up x) over all
    N * T calibration tokens, float32 on the CPU, captured with forward pre-hooks."""
    layers = dense.model.layers
    xs, acts = [[] for _ in layers], [[] for _ in layers]
    pairs = []
    for i, layer in enumerate(layers):
        pairs.append(
            (layer.mlp, lambda m, args, i=i: xs[i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu()))
        )
        pairs.append(
            (
                layer.mlp.down_proj,
                lambda m, args, i=i: acts[i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu()),
            )
        )
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
                dense.model(input_ids=input_ids[s : s + batch_size].to(device), use_cache=False)  # lm_head not needed
    finally:
        dense.train(was_training)
    return [(torch.cat(x), torch.cat(a)) for x, a in zip(xs, acts)]


def _moe_config(dense, n_experts: int, top_k: int, shared: int, expert_scale: float):
    from transformers import Qwen2MoeConfig

    cfg = dense.config
    return Qwen2MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=(cfg.intermediate_size - shared) // n_experts,
        shared_expert_intermediate_size=shared,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=_qkv_bias(dense),
        use_sliding_window=False,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps,
        use_cache=cfg.use_cache,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=cfg.attention_dropout,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        rope_parameters=copy.deepcopy(cfg.rope_parameters),
        moefy_expert_scale=float(expert_scale),
        moefy_shared_share=shared / cfg.intermediate_size,
    )


ALIGN = 8  # the routed expert width must be a multiple of this: the grouped expert GEMM wants 16-byte strides


def _shared_width(share, intermediate: int, n_experts: int) -> int:
    """round(share * I) neurons for the shared expert, leaving a routed width (I - S) / E that is a
    whole multiple of ALIGN."""
    if isinstance(share, bool) or not isinstance(share, numbers.Real) or not (0 <= share < 1):
        raise ValueError(f"moefy: shared_share={share!r} must be a number in [0, 1)")
    width = int(round(float(share) * intermediate))
    rest = intermediate - width
    if rest % n_experts or (rest // n_experts) % ALIGN:
        good = [
            f"{s / intermediate:g}" for s in range(0, intermediate) if (intermediate - s) % (n_experts * ALIGN) == 0
        ][:6]
        raise ValueError(
            f"moefy: shared_share={share!r} leaves {rest} of intermediate_size={intermediate} neurons "
            f"for n_experts={n_experts} routed experts, which must divide them into widths that are "
            f"multiples of {ALIGN}; shares that do: {', '.join(good) or 'none (change n_experts)'}"
        )
    return width


def moefy(
    dense: nn.Module,
    calib_input_ids: torch.Tensor,
    n_experts: int = 8,
    top_k: int = 2,
    shared_share: float = 0.0,
    seed: int = 0,
    expert_scale: float | None = None,
    ridge: float = 1e-3,
    iters: int = 30,
    batch_size: int = 8,
    progress: bool = False,
):
    """Split every FFN of a dense Llama / Qwen2 model into a shared expert and `n_experts` routed
    experts and fit routers: a Qwen2-MoE and its MoefyReport (see the module docstring)."""
    from transformers import Qwen2MoeForCausalLM
    from transformers.initialization import no_init_weights

    from crucible.moe.moefy_fit import shared_neurons

    _check_dense(dense)
    cfg = dense.config
    n_experts = _int_param(n_experts, "n_experts", 1)
    shared = _shared_width(shared_share, cfg.intermediate_size, n_experts)
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
    width = (cfg.intermediate_size - shared) // n_experts

    report = MoefyReport(
        n_experts=n_experts,
        top_k=top_k,
        shared_share=shared / cfg.intermediate_size,
        expert_scale=scale,
        seed=int(seed),
        n_tokens=ids.numel(),
    )
    t0 = time.perf_counter()
    captured = capture_ffn(dense, ids, batch_size, progress)
    report.seconds["capture"] = time.perf_counter() - t0

    layer_iter = enumerate(captured)
    if progress:
        from crucible.progress import Progress

        layer_iter = Progress(layer_iter, total=len(captured), desc="moefy: layers", unit="layer")
    splits, cluster_s, router_s = [], 0.0, 0.0
    for i, (x, a) in layer_iter:
        t0 = time.perf_counter()
        common = shared_neurons(a, shared, active=shared + top_k * width)
        rest = torch.from_numpy(np.setdiff1d(np.arange(a.shape[1]), common.numpy()))
        groups = rest[balanced_groups(a[:, rest], n_experts, seed=derive_seed(int(seed), "moefy", i), iters=iters)]
        cluster_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        mass = group_mass(a, groups)
        weight = fit_router(x, mass, ridge)
        quality = router_quality(x, mass, weight, top_k)
        total = a.abs().double().sum(1).clamp_min(1e-12)
        shared_mass = a[:, common].abs().double().sum(1) / total
        chosen = (x.double() @ weight.double().T).topk(top_k, dim=1).indices
        active_mass = shared_mass + mass.gather(1, chosen).sum(1) / total
        router_s += time.perf_counter() - t0
        report.layers.append(
            LayerReport(
                groups=groups.tolist(),
                shared=common.tolist(),
                shared_mass=float(shared_mass.mean()),
                active_mass=float(active_mass.mean()),
                **quality,
            )
        )
        splits.append((common, groups, weight))
    captured.clear()
    report.seconds["cluster"], report.seconds["router"] = cluster_s, router_s

    t0 = time.perf_counter()
    dtype = next(dense.parameters()).dtype
    with no_init_weights():  # every parameter is loaded below
        moe = Qwen2MoeForCausalLM(_moe_config(dense, n_experts, top_k, shared, scale))
    moe.to(dtype=dtype, device=next(dense.parameters()).device)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    for i, (common, groups, weight) in enumerate(splits):
        mlp = dense.model.layers[i].mlp
        prefix = f"model.layers.{i}.mlp."
        state[prefix + "experts.gate_up_proj"] = torch.cat(
            [mlp.gate_proj.weight[groups], mlp.up_proj.weight[groups]], dim=1
        )  # [E, 2w, H]
        state[prefix + "experts.down_proj"] = mlp.down_proj.weight[:, groups].permute(1, 0, 2) * scale  # [E, H, w]
        state[prefix + "gate.weight"] = weight.to(dtype)
        state[prefix + "shared_expert.gate_proj.weight"] = mlp.gate_proj.weight[common]
        state[prefix + "shared_expert.up_proj.weight"] = mlp.up_proj.weight[common]
        state[prefix + "shared_expert.down_proj.weight"] = mlp.down_proj.weight[:, common] * 2.0  # x sigmoid(0) = 1
        state[prefix + "shared_expert_gate.weight"] = torch.zeros(1, cfg.hidden_size, dtype=dtype)
    moe.load_state_dict(state, strict=True)
    from crucible.moe.dense import tie_embeddings

    tie_embeddings(moe)
    dense_rope, moe_rope = dense.model.rotary_emb, moe.model.rotary_emb
    if not (
        torch.equal(dense_rope.inv_freq, moe_rope.inv_freq)
        and dense_rope.attention_scaling == moe_rope.attention_scaling
    ):
        raise RuntimeError(
            f"moefy: the Qwen2-MoE rotary embedding differs from the dense one (rope_parameters={cfg.rope_parameters})"
        )
    report.seconds["build"] = time.perf_counter() - t0
    return moe.eval(), report


def set_top_k(model: nn.Module, top_k: int) -> nn.Module:
    """Every router selects `top_k` experts from now on; the routed experts' down_proj is rescaled by
    top_k / the old top_k when the recorded moefy_expert_scale equals the old top_k (so the combine
    keeps each selected expert near unit weight). In place; returns the model."""
    from crucible.moe.routing import moe_layers

    blocks = list(moe_layers(model).values())
    n_experts = int(blocks[0].gate.weight.shape[0])
    top_k = _int_param(top_k, "top_k", 1, n_experts, where="set_top_k")
    old = int(model.config.num_experts_per_tok)
    scale = getattr(model.config, "moefy_expert_scale", None)
    rescale = scale is not None and float(scale) == float(old)
    with torch.no_grad():
        for block in blocks:
            block.gate.top_k = top_k
            if rescale:
                block.experts.down_proj.mul_(top_k / old)
    model.config.num_experts_per_tok = top_k
    if rescale:
        model.config.moefy_expert_scale = float(top_k)
    return model


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

    routers = [
        m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module) and hasattr(m, "experts")
    ]
    if not routers:
        raise ValueError(
            f"all_experts_unit_weight: {type(model).__name__} has no MoE block (a module with `gate` and `experts`)"
        )
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
