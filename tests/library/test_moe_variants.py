"""crucible.moe.variants.quantize_variants on a tiny random Mixtral: the whole comparison (float, MXFP4,
uniform and load-aware compensation at the same total rank, replay QAT) end to end, its metrics,
determinism, and argument errors."""

import json
import math

import pytest
import torch

from crucible.moe.lm import perplexity
from crucible.moe.mx_experts import MXExperts
from crucible.moe.variant_eval import evaluate_variant, float_reference
from crucible.moe.variants import compensated_matrices, default_rank_budget, max_rank_budget, quantize_variants
from support.moe_models import VOCAB, tiny_mixtral

torch.set_num_threads(1)

QUANTIZED = ("mxfp4", "uniform", "load_aware", "qat")


def _ids(n, t, seed):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def case():
    model = tiny_mixtral(seed=0, init=0.1)
    calib, held = _ids(8, 16, 1), _ids(6, 16, 2)
    budget = default_rank_budget(model)
    out = quantize_variants(model, calib, held, rank_budget=budget, qat_steps=6, qat_lr=3e-3, seed=0, batch_size=2)
    return model, calib, held, budget, out


def _numbers(obj, path="metrics"):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def _without_seconds(metrics):
    return {k: v for k, v in metrics.items() if k != "seconds"}


def test_end_to_end_metrics(case):
    model, calib, held, budget, out = case
    m = out.metrics
    json.dumps(m)  # serialisable
    assert set(m["variants"]) == {"float", *QUANTIZED}
    bad = [(p, v) for p, v in _numbers(m) if not math.isfinite(v)]
    assert not bad, bad[:5]
    layers = list(m["load_calib"])
    assert layers == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for row in m["load_calib"].values():  # each expert's share of calibration tokens, summing to top_k
        assert sum(row) == pytest.approx(2.0)
    fl = m["variants"]["float"]
    assert fl["perplexity"] == pytest.approx(perplexity(model, held, batch_size=2), rel=1e-12)
    assert all(c == {"set": 1.0, "top1": 1.0} for c in fl["consistency"].values())
    assert fl["consistency_mean"] == {"set": 1.0, "top1": 1.0} and fl["token_agreement"] == 1.0
    assert all(d == 0.0 for d in fl["drift"].values())
    again = evaluate_variant(model, held, float_reference(model, held, batch_size=2))  # a real pass of the float model
    assert again["consistency_mean"] == {"set": 1.0, "top1": 1.0} and all(d == 0.0 for d in again["drift"].values())
    assert again["perplexity"] == fl["perplexity"] and again["load"] == fl["load"] and again["token_agreement"] == 1.0
    for name in QUANTIZED:
        v = m["variants"][name]
        assert set(v["consistency"]) == set(layers) and len(v["drift"]) == model.config.num_hidden_layers
        assert all(0.0 <= c["set"] <= 1.0 and 0.0 <= c["top1"] <= 1.0 for c in v["consistency"].values())
        assert v["drift_mean"] > 0 and v["bits_per_weight"] < fl["bits_per_weight"] and 0 < v["token_agreement"] <= 1
    assert m["variants"]["mxfp4"]["bytes"]["expert_adapters"] == 0
    assert m["variants"]["uniform"]["bytes"]["expert_adapters"] > 0
    assert m["variants"]["qat"]["perplexity"] != m["variants"]["load_aware"]["perplexity"]  # the adapters trained
    assert m["qat"]["start"] == "load_aware" and len(m["qat"]["history"]) == 6
    assert {"plan (quantization error SVD)", "qat (from load_aware)", "eval qat"} <= set(m["seconds"])


def test_equal_total_rank_and_rank_table(case):
    model, _, _, budget, out = case
    r = out.metrics["ranks"]
    assert budget == 8 * len(compensated_matrices(model)) and budget <= max_rank_budget(model)
    assert r["total"] == {"uniform": budget, "load_aware": budget}
    assert sum(out.ranks["uniform"].values()) == sum(out.ranks["load_aware"].values()) == budget
    assert out.ranks["uniform"] != out.ranks["load_aware"]
    assert r["weighted_error"]["load_aware"] <= r["weighted_error"]["uniform"] < r["weighted_error"]["none"]
    rows = r["matrices"]
    assert [row["name"] for row in rows] == list(out.ranks["uniform"])
    experts = [row for row in rows if row["expert"] is not None]
    assert len(experts) == 2 * 2 * 4 and {row["kind"] for row in experts} == {"gate_up", "down"}
    assert {row["kind"] for row in rows if row["expert"] is None} == {"q", "k", "v", "o"}
    assert all(row["load"] == 1.0 for row in rows if row["expert"] is None)
    load = out.metrics["load_calib"]["model.layers.1.mlp"]
    assert [row["load"] for row in experts if row["module"] == "model.layers.1.mlp.experts"
            and row["kind"] == "down"] == load
    # the returned model is the trained load-aware one, with those ranks
    q = out.model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(q, MXExperts)
    assert q.ranks["down"] == [out.ranks["load_aware"][f"model.layers.1.mlp.experts.down_proj.{e}"] for e in range(4)]


def test_same_seed_same_metrics_and_reference_reuse(case):
    model, calib, held, budget, out = case
    again = quantize_variants(model, calib, held, rank_budget=budget, qat_steps=6, qat_lr=3e-3, seed=0, batch_size=2)
    assert _without_seconds(again.metrics) == _without_seconds(out.metrics)
    ref = float_reference(model, held, batch_size=2)
    reused = quantize_variants(model, calib, held, rank_budget=budget, qat_steps=6, qat_lr=3e-3, seed=0, batch_size=2,
                               reference=ref, include_float=False, include_mxfp4=False)
    assert set(reused.metrics["variants"]) == {"uniform", "load_aware", "qat"}
    for name in ("uniform", "load_aware", "qat"):
        assert reused.metrics["variants"][name] == out.metrics["variants"][name]
    other = quantize_variants(model, calib, held, rank_budget=budget, qat_steps=6, qat_lr=3e-3, seed=1, batch_size=2,
                              reference=ref, include_float=False, include_mxfp4=False)
    assert other.metrics["qat"]["history"] != out.metrics["qat"]["history"]  # the seed orders the QAT batches


def test_bad_arguments_raise_before_any_work(case):
    model, calib, held, _, _ = case
    top = max_rank_budget(model)
    for bad in (0, -3, top + 1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=rf"rank_budget must be an int in \[1, {top}\].*got {bad!r}"):
            quantize_variants(model, calib, held, rank_budget=bad)
    with pytest.raises(ValueError, match=r"calib_ids must be an integer tensor \[N, T\]"):
        quantize_variants(model, calib.float(), held, rank_budget=8)
    with pytest.raises(ValueError, match=r"eval_ids holds ids in \[.*outside the vocabulary \[0, 128\)"):
        quantize_variants(model, calib, held + VOCAB, rank_budget=8)
    with pytest.raises(ValueError, match="qat_loss must be one of"):
        quantize_variants(model, calib, held, rank_budget=8, qat_loss="mse")
    with pytest.raises(ValueError, match="qat_lr must be a finite number > 0"):
        quantize_variants(model, calib, held, rank_budget=8, qat_lr=0.0)
    ref = float_reference(model, held[:4], batch_size=2)
    with pytest.raises(ValueError, match=r"the reference was taken on eval_ids \[4, 16\]"):
        quantize_variants(model, calib, held, rank_budget=8, batch_size=2, reference=ref)


def test_qat_checkpoints_resume(case, tmp_path):
    model, calib, held, budget, out = case
    kw = dict(rank_budget=budget, qat_lr=3e-3, seed=0, batch_size=2, include_float=False, include_mxfp4=False,
              checkpoint_dir=tmp_path, checkpoint_every=2)
    first = quantize_variants(model, calib, held, qat_steps=4, **kw)
    assert (tmp_path / "qat").is_dir()
    resumed = quantize_variants(model, calib, held, qat_steps=6, **kw)  # continues from step 4
    assert resumed.metrics["qat"]["history"][:4] == first.metrics["qat"]["history"]
    assert resumed.metrics["variants"]["qat"] == out.metrics["variants"]["qat"]  # = an uninterrupted 6-step run
