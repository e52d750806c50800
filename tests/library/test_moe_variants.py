"""crucible.moe.variants.quantize_variants on a tiny random Mixtral (and a Qwen2-MoE with a shared
expert): the whole comparison (float, MXFP4, uniform, load-aware and propagation-aware load-aware
compensation at the same total rank, replay QAT from the best by calibration KL) end to end, its
metrics, determinism, the shared expert quantized or kept float, and argument errors."""

import json
import math

import pytest
import torch
from support.moe_models import VOCAB, tiny_mixtral, tiny_qwen2moe

from crucible.moe.lm import perplexity
from crucible.moe.mx_experts import MXExperts
from crucible.moe.mx_storage import moe_nbytes
from crucible.moe.variant_eval import calibration_fit, evaluate_variant, float_reference
from crucible.moe.variants import compensated_matrices, default_rank_budget, max_rank_budget, quantize_variants
from crucible.quant.linear import MXLinear

torch.set_num_threads(1)

QUANTIZED = ("mxfp4", "uniform", "load_aware", "load_aware_prop", "qat")
COMPENSATED = ("uniform", "load_aware", "load_aware_prop")


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
    sel = m["selection"]
    assert sel["by"] == "calibration kl" and set(sel["candidates"]) == set(COMPENSATED)
    kl = {k: c["kl"] for k, c in sel["candidates"].items()}
    assert sel["start"] == min(kl, key=kl.get) == m["qat"]["start"] and all(v > 0 for v in kl.values())
    assert len(m["qat"]["history"]) == 6
    assert {
        "plan (quantization error SVD)",
        "output sensitivity (calib)",
        f"qat (from {sel['start']})",
        "eval qat",
    } <= set(m["seconds"])


def test_equal_total_rank_and_rank_table(case):
    model, _, _, budget, out = case
    r = out.metrics["ranks"]
    assert budget == 8 * len(compensated_matrices(model)) and budget <= max_rank_budget(model)
    assert r["total"] == {a: budget for a in COMPENSATED}
    assert all(sum(out.ranks[a].values()) == budget for a in COMPENSATED)
    assert out.ranks["uniform"] != out.ranks["load_aware"] != out.ranks["load_aware_prop"] != out.ranks["uniform"]
    for a in COMPENSATED:  # where the rank went: by group and by layer, each summing to the budget
        assert sum(r["groups"][a].values()) == budget and sum(r["layers"][a]) == budget
        assert len(r["layers"][a]) == model.config.num_hidden_layers
    assert r["groups"]["uniform"]["shared"] == 0 and r["groups"]["uniform"]["attention"] > 0
    we, wp = r["weighted_error"], r["weighted_error_prop"]  # each greedy allocation minimises its own objective
    assert we["load_aware"] <= min(we["uniform"], we["load_aware_prop"]) and we["uniform"] < we["none"]
    assert wp["load_aware_prop"] <= min(wp["uniform"], wp["load_aware"]) and wp["uniform"] < wp["none"]
    rows = r["matrices"]
    assert all(
        row["load_prop"] > 0 and row["load_aware_prop"] == out.ranks["load_aware_prop"][row["name"]] for row in rows
    )
    assert [row["name"] for row in rows] == list(out.ranks["uniform"])
    experts = [row for row in rows if row["expert"] is not None]
    assert len(experts) == 2 * 2 * 4 and {row["kind"] for row in experts} == {"gate_up", "down"}
    assert {row["kind"] for row in rows if row["expert"] is None} == {"q", "k", "v", "o"}
    assert all(row["load"] == 1.0 for row in rows if row["expert"] is None)
    load = out.metrics["load_calib"]["model.layers.1.mlp"]
    assert [
        row["load"] for row in experts if row["module"] == "model.layers.1.mlp.experts" and row["kind"] == "down"
    ] == load
    # the returned model is the trained QAT start, with its ranks
    start = out.metrics["qat"]["start"]
    q = out.model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(q, MXExperts)
    assert q.ranks["down"] == [out.ranks[start][f"model.layers.1.mlp.experts.down_proj.{e}"] for e in range(4)]


def test_same_seed_same_metrics_and_reference_reuse(case):
    model, calib, held, budget, out = case
    again = quantize_variants(model, calib, held, rank_budget=budget, qat_steps=6, qat_lr=3e-3, seed=0, batch_size=2)
    assert _without_seconds(again.metrics) == _without_seconds(out.metrics)
    ref = float_reference(model, held, batch_size=2)
    reused = quantize_variants(
        model,
        calib,
        held,
        rank_budget=budget,
        qat_steps=6,
        qat_lr=3e-3,
        seed=0,
        batch_size=2,
        reference=ref,
        include_float=False,
        include_mxfp4=False,
    )
    assert set(reused.metrics["variants"]) == {*COMPENSATED, "qat"}
    for name in (*COMPENSATED, "qat"):
        assert reused.metrics["variants"][name] == out.metrics["variants"][name]
    other = quantize_variants(
        model,
        calib,
        held,
        rank_budget=budget,
        qat_steps=6,
        qat_lr=3e-3,
        seed=1,
        batch_size=2,
        reference=ref,
        include_float=False,
        include_mxfp4=False,
    )
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
    with pytest.raises(ValueError, match=r"qat_start must be one of \('best', 'uniform', 'load_aware'\)"):
        quantize_variants(model, calib, held, rank_budget=8, qat_start="load_aware_prop", propagation=False)
    ref = float_reference(model, held[:4], batch_size=2)
    with pytest.raises(ValueError, match=r"the reference was taken on eval_ids \[4, 16\]"):
        quantize_variants(model, calib, held, rank_budget=8, batch_size=2, reference=ref)


def test_qat_checkpoints_resume(case, tmp_path):
    model, calib, held, budget, out = case
    kw = dict(
        rank_budget=budget,
        qat_lr=3e-3,
        seed=0,
        batch_size=2,
        include_float=False,
        include_mxfp4=False,
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
    )
    first = quantize_variants(model, calib, held, qat_steps=4, **kw)
    assert (tmp_path / "qat").is_dir()
    resumed = quantize_variants(model, calib, held, qat_steps=6, **kw)  # continues from step 4
    assert resumed.metrics["qat"]["history"][:4] == first.metrics["qat"]["history"]
    assert resumed.metrics["variants"]["qat"] == out.metrics["variants"]["qat"]  # = an uninterrupted 6-step run


def test_the_best_start_is_the_lowest_calibration_kl_and_a_named_start_is_honoured(case):
    model, calib, held, budget, out = case
    kw = dict(
        rank_budget=budget, qat_steps=2, qat_lr=3e-3, seed=0, batch_size=2, include_float=False, include_mxfp4=False
    )
    named = quantize_variants(model, calib, held, qat_start="uniform", **kw)
    assert named.metrics["qat"]["start"] == "uniform" and named.metrics["selection"]["by"] == "named"
    assert named.model.get_submodule("model.layers.0.mlp.experts").ranks["gate_up"] == [
        named.ranks["uniform"][f"model.layers.0.mlp.experts.gate_up_proj.{e}"] for e in range(4)
    ]
    none = quantize_variants(
        model, calib, held, qat_steps=0, propagation=False, **{k: v for k, v in kw.items() if k != "qat_steps"}
    )
    assert set(none.metrics["variants"]) == {"uniform", "load_aware"} and none.metrics["qat"] is None
    assert "weighted_error_prop" not in none.metrics["ranks"]
    # calibration_fit: the float MoE against itself has KL 0 and its own calibration perplexity
    fit = calibration_fit(model, model, list(calib.split(2)))
    assert fit["kl"] == pytest.approx(0.0, abs=1e-6) and fit["perplexity"] > 1


@pytest.mark.parametrize("shared", [True, False])
def test_shared_expert_quantized_or_kept_float(shared):
    model = tiny_qwen2moe(seed=2, init=0.1)
    calib, held = _ids(6, 16, 3), _ids(4, 16, 4)
    budget = default_rank_budget(model, shared=shared)
    out = quantize_variants(
        model, calib, held, rank_budget=budget, qat_steps=2, qat_lr=3e-3, seed=0, batch_size=2, shared=shared
    )
    r = out.metrics["ranks"]
    assert all(r["total"][a] == budget for a in COMPENSATED)
    shared_rows = [row for row in r["matrices"] if row["group"] == "shared"]
    assert len(shared_rows) == (3 * 2 if shared else 0)
    assert all(row["load"] == 1.0 for row in shared_rows)
    lin = out.model.get_submodule("model.layers.0.mlp.shared_expert.up_proj")
    assert isinstance(lin, MXLinear) == shared
    assert isinstance(out.model.get_submodule("model.layers.0.mlp.shared_expert_gate"), torch.nn.Linear)
    size = moe_nbytes(out.model)
    float_shared = sum(
        p.numel() for n, p in out.model.named_parameters() if ".shared_expert." in n and n.endswith(".weight")
    )
    assert (float_shared == 0) == shared
    v = out.metrics["variants"]["mxfp4"]
    assert v["bytes"]["total"] == size["total"] - sum(size[k] for k in ("expert_adapters", "linear_adapters"))


def test_a_kept_calibration_gives_the_shared_float_setting_the_same_numbers():
    model = tiny_qwen2moe(seed=2, init=0.1)
    calib, held = _ids(6, 16, 3), _ids(4, 16, 4)
    kw = dict(qat_steps=2, qat_lr=3e-3, seed=0, batch_size=2)
    full = quantize_variants(model, calib, held, rank_budget=default_rank_budget(model), keep_calibration=True, **kw)
    budget = default_rank_budget(model, shared=False)
    reused = quantize_variants(model, calib, held, rank_budget=budget, shared=False, calibration=full.calibration, **kw)
    fresh = quantize_variants(model, calib, held, rank_budget=budget, shared=False, **kw)
    assert fresh.calibration is None and "calibration (reused)" in reused.metrics["seconds"]
    assert _without_seconds(reused.metrics) == _without_seconds(fresh.metrics)
    with pytest.raises(ValueError, match="kept for other calib_ids"):
        quantize_variants(model, calib[:4], held, rank_budget=budget, shared=False, calibration=full.calibration, **kw)
    with pytest.raises(ValueError, match="has no plan for"):
        quantize_variants(
            model,
            calib,
            held,
            rank_budget=default_rank_budget(model),
            calibration=_kept_without_shared(model, calib, held, budget, kw),
            **kw,
        )


def _kept_without_shared(model, calib, held, budget, kw):
    return quantize_variants(
        model, calib, held, rank_budget=budget, shared=False, keep_calibration=True, **kw
    ).calibration
