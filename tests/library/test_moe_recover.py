"""crucible.moe.recover on a tiny random Llama split into a Qwen2-MoE with a shared expert: the
distillation lowers the KL to the dense model, trains only what it says, resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from support.moe_models import tiny_llama

from crucible.moe.build import moefy
from crucible.moe.recover import recover, trainable_parameters


def ids(seed: int, n: int = 8, t: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    dense = tiny_llama(seed=1)
    moe, _ = moefy(dense, ids(2), n_experts=4, top_k=1, shared_share=0.25, seed=0)
    return dense, moe


def batches():
    return list(ids(3).split(4))


def kl(moe, dense, batch):
    with torch.no_grad():
        p = torch.log_softmax(dense(input_ids=batch).logits.float(), -1)
        q = torch.log_softmax(moe(input_ids=batch).logits.float(), -1)
    return float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean())


@pytest.mark.parametrize("train", ["router", "experts", "layers"])
def test_recovery_lowers_the_kl_and_trains_only_its_parameters(pair, train):
    dense, built = pair
    moe = copy.deepcopy(built)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    names = set(trainable_parameters(moe, train))
    start = sum(kl(moe, dense, b) for b in batches())
    history = recover(
        moe, dense, batches(), steps=12, lr=1e-2 if train == "router" else 3e-3, train=train, progress=False
    )
    assert [h["step"] for h in history] == list(range(1, 13)) and sorted({h["batch"] for h in history}) == [0, 1]
    # the routers alone move the MoE less than the experts do
    assert sum(kl(moe, dense, b) for b in batches()) < (0.97 if train == "router" else 0.8) * start
    after = moe.state_dict()
    for key, value in before.items():
        changed = not torch.equal(after[key], value)
        assert changed == (key in names), key
    assert all(p.requires_grad for p in moe.parameters()) and not moe.training  # flags restored
    if train == "router":
        assert names == {f"model.layers.{i}.mlp.{n}.weight" for i in range(2) for n in ("gate", "shared_expert_gate")}
    if train == "layers":  # attention and norms of the MoE's decoder layers, not embeddings or the head
        assert {
            f"model.layers.{i}.{n}.weight"
            for i in range(2)
            for n in ("self_attn.q_proj", "self_attn.o_proj", "input_layernorm", "mlp.gate")
        } <= names
        assert not any(n.startswith(("model.embed_tokens", "model.norm", "lm_head")) for n in names)


def test_resumed_recovery_ends_where_an_uninterrupted_one_does(pair, tmp_path):
    dense, built = pair
    straight, resumed = copy.deepcopy(built), copy.deepcopy(built)
    recover(straight, dense, batches(), steps=4, lr=1e-2, progress=False, seed=5)
    recover(resumed, dense, batches(), steps=2, lr=1e-2, progress=False, seed=5, checkpoint_dir=tmp_path)
    fresh = copy.deepcopy(built)  # a new process: the model as built, the checkpoint on disk
    history = recover(fresh, dense, batches(), steps=4, lr=1e-2, progress=False, seed=5, checkpoint_dir=tmp_path)
    assert len(history) == 4
    for (k, a), b in zip(straight.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match=r"other settings.*'lr': \(0.01, 0.02\)"):
        recover(
            copy.deepcopy(built), dense, batches(), steps=6, lr=2e-2, progress=False, seed=5, checkpoint_dir=tmp_path
        )
    with pytest.raises(ValueError, match=r"other settings.*'start'"):  # another model's checkpoint
        recover(straight, dense, batches(), steps=6, lr=1e-2, progress=False, seed=5, checkpoint_dir=tmp_path)


def test_a_recovery_past_its_teacher_cache_recomputes_the_same_targets(pair):
    dense, built = pair
    cached, bounded, uncached = (copy.deepcopy(built) for _ in range(3))
    one_batch = 4 * 24 * dense.config.vocab_size * 4  # bytes of one batch's float32 log-probabilities
    h_cached = recover(cached, dense, batches(), steps=5, lr=1e-2, progress=False, seed=3)
    h_bounded = recover(bounded, dense, batches(), steps=5, lr=1e-2, progress=False, seed=3, cache_bytes=one_batch)
    h_uncached = recover(uncached, dense, batches(), steps=5, lr=1e-2, progress=False, seed=3, cache_bytes=0)
    assert h_cached == h_bounded == h_uncached
    for (k, a), b, c in zip(cached.state_dict().items(), bounded.state_dict().values(), uncached.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), k


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cache_bytes=-1), r"cache_bytes=-1"),
        (dict(steps=-1), r"steps=-1"),
        (dict(lr=float("nan")), r"lr=nan"),
        (dict(train="all"), r"train='all'"),
        (dict(temperature=0), r"temperature=0"),
        (dict(batches=[]), r"batches is empty"),
    ],
)
def test_bad_arguments_are_named(pair, kwargs, match):
    dense, moe = pair
    args = dict(batches=batches(), steps=1, progress=False) | kwargs
    with pytest.raises(ValueError, match=match):
        recover(copy.deepcopy(moe), dense, **args)


def test_a_dense_model_without_moe_blocks_is_refused(pair):
    dense, _ = pair
    with pytest.raises(ValueError, match=r"no MoE layer"):
        recover(dense, dense, batches(), steps=1, progress=False)
