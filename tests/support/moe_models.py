"""Tiny seeded MoE language models (transformers Mixtral, Qwen3-MoE and Qwen2-MoE with a shared
expert, random weights), tiny dense Llamas to split, and token
batches for the crucible.moe tests. Nothing is downloaded."""

from __future__ import annotations

import copy

import torch

VOCAB = 128


def tiny_mixtral(
    seed: int = 0,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 64,
    intermediate: int = 64,
    init: float = 0.02,
    router_init: float | None = None,
    tie: bool = False,
):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
        initializer_range=init,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    _scale_routers(model, router_init, seed)
    return model


def tiny_qwen3(
    seed: int = 0,
    layers: int = 3,
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 64,
    intermediate: int = 64,
    norm_topk_prob: bool = False,
    mlp_only_layers=(1,),
    init: float = 0.02,
    router_init: float | None = None,
):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        moe_intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=64,
        initializer_range=init,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    _scale_routers(model, router_init, seed)
    return model


def tiny_qwen2moe(
    seed: int = 0,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 64,
    intermediate: int = 64,
    shared: int = 32,
    init: float = 0.02,
    router_init: float | None = None,
    norm_topk_prob: bool = True,
):
    """The architecture crucible.moe.build.moefy writes: routed experts plus a sigmoid-gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        moe_intermediate_size=intermediate,
        shared_expert_intermediate_size=shared,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        qkv_bias=False,
        max_position_embeddings=64,
        initializer_range=init,
    )
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(cfg).eval()
    _scale_routers(model, router_init, seed)
    return model


def tiny_llama(seed: int = 0, hidden: int = 64, intermediate: int = 128, layers: int = 2, vocab: int = 256, **extra):
    """A dense Llama whose FFN carries weight (the default std 0.02 leaves it nearly silent)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.normal_(0, 0.15)
    return model


def _scale_routers(model, std, seed):
    """Routers with their own std (a larger one makes the routing less sensitive to noise)."""
    if std is None:
        std = model.config.initializer_range
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)


def token_batches(n: int = 4, batch: int = 2, seq: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def clone(model):
    return copy.deepcopy(model)
