"""MXLinear, quantize_model, save/load of a quantized model, calibration statistics and the
whole-model compensation plan (crucible.quant.linear, crucible.quant.compensate)."""

import copy

import pytest
import torch
from torch import nn

from crucible.quant import (
    CompensationPlan,
    MXLinear,
    collect_input_stats,
    dequantize,
    load_quantized,
    quantize,
    quantize_model,
    save_quantized,
    select_linears,
)
from crucible.quant.linear import mx_layers

torch.set_num_threads(1)


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=50,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
    )
    return BertModel(cfg).eval()


def batch(seed: int = 0, b: int = 3, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 5:] = 0
    return ids, mask


def hidden(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


PATTERN = r"encoder\.layer\.\d+\."


def test_mxlinear_forward_is_dequantized_linear_plus_adapter():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 48)
    a, b = torch.randn(48, 3, generator=g), torch.randn(3, 64, generator=g)
    layer = MXLinear.from_linear(lin, adapter=(a, b), adapter_dtype="float32")
    x = torch.randn(5, 2, 64, generator=g)
    w = dequantize(quantize(lin.weight.detach()))
    expect = x @ w.T + lin.bias.detach() + (x @ b.T) @ a.T
    torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.effective_weight(), w + a @ b, rtol=1e-6, atol=1e-6)
    assert layer.rank == 3 and layer.nbytes() == {
        "packed": 48 * 32,
        "scales": 48 * 2,
        "adapter": 3 * 112 * 4,
        "bias": 48 * 4,
    }
    # bf16 storage: the adapter held for compute is the bf16-rounded one
    layer16 = MXLinear.from_linear(lin, adapter=(a, b))
    assert torch.equal(layer16.lora_a, a.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="expected A"):
        layer.set_adapter(a[:, :2], b)
    with pytest.raises(ValueError, match="input has 32 features"):
        layer(torch.randn(2, 32))


def test_mxlinear_refuses_bad_weights():
    lin = nn.Linear(64, 8)
    with torch.no_grad():
        lin.weight[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"fc\.weight: non-finite value nan at \[2, 5\]"):
        MXLinear.from_linear(lin, name="fc")
    with pytest.raises(ValueError, match="in_features = 40 is not a multiple of 32"):
        MXLinear.from_linear(nn.Linear(40, 8))


def test_quantize_model_swaps_matching_layers_only_and_is_all_or_nothing():
    model = tiny_bert()
    names = list(select_linears(model, PATTERN))
    assert len(names) == 12 and all(n.startswith("encoder.layer.") for n in names)
    assert "pooler.dense" not in names
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.dense\.weight: non-finite"):
        quantize_model(model, PATTERN)
    assert not mx_layers(model)  # nothing swapped
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[0, 0] = before["encoder.layer.1.output.dense.weight"][0, 0]
    layers = quantize_model(model, PATTERN)
    assert set(layers) == set(names) and isinstance(model.pooler.dense, nn.Linear)
    assert isinstance(model.encoder.layer[0].attention.self.query, MXLinear)
    with pytest.raises(ValueError, match="matches no nn.Linear.*pooler.dense"):
        select_linears(model, r"decoder\.")
    with pytest.raises(ValueError, match="invalid module regex"):
        select_linears(model, r"encoder\.(")


def test_saved_and_reloaded_model_gives_the_same_outputs(tmp_path):
    model = tiny_bert()
    ids, mask = batch()
    lin = select_linears(model, PATTERN)
    plan = CompensationPlan.build(lin, scaling="plain")
    quantize_model(model, PATTERN, adapters=plan.adapters(plan.ranks(40, "load_aware")))
    out = hidden(model, ids, mask)
    path = tmp_path / "q.safetensors"
    save_quantized(model, path, metadata={"note": "test"})
    skeleton = tiny_bert(seed=123)  # other random weights: everything must come from the file
    loaded = load_quantized(path, skeleton)
    assert torch.equal(hidden(loaded, ids, mask), out)
    assert sum(m.rank for m in mx_layers(loaded).values()) == 40
    # the file holds no float copy of a quantized weight
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        keys = set(fh.keys())
    assert "encoder.layer.0.attention.self.query.weight" not in keys
    assert "encoder.layer.0.attention.self.query.packed" in keys


def test_load_quantized_refuses_truncated_foreign_and_incomplete_files(tmp_path):
    model = tiny_bert()
    quantize_model(model, PATTERN)
    data = save_quantized(model)
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="trunc.safetensors: not a readable safetensors file"):
        load_quantized(bad, tiny_bert())
    from transformers import BertConfig, BertModel

    other = BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=32,
        )
    )
    good = tmp_path / "q.safetensors"
    good.write_bytes(data)
    with pytest.raises(
        ValueError, match=r"q.safetensors: layer 'encoder\.layer\.0\.[a-z.]+' is 64 x 64 in the file but Linear 96 x 96"
    ):
        load_quantized(good, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(good))
    del tensors["embeddings.word_embeddings.weight"]
    from safetensors import safe_open

    with safe_open(str(good), "pt") as fh:
        meta = fh.metadata()
    partial = tmp_path / "partial.safetensors"
    save_file(tensors, str(partial), metadata=meta)
    with pytest.raises(ValueError, match=r"missing \['embeddings.word_embeddings.weight'\]"):
        load_quantized(partial, tiny_bert())
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="not a quantized model"):
        load_quantized(plain, tiny_bert())


def test_input_stats_count_unpadded_tokens_only():
    model = tiny_bert()
    ids, mask = batch()
    name = "encoder.layer.0.attention.self.query"
    seen = []
    handle = model.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    hidden(model, ids, mask)
    handle.remove()
    rows = seen[0][mask.bool()]
    stats = collect_input_stats(
        model, [name], [(ids, mask)], forward=lambda m, b: m(input_ids=b[0], attention_mask=b[1]), masks=lambda b: b[1]
    )[name]
    assert stats.count == int(mask.sum()) == rows.shape[0]
    torch.testing.assert_close(stats.sum_sq, (rows.double() ** 2).sum(0))
    torch.testing.assert_close(stats.sum_abs, rows.double().abs().sum(0))


def test_full_rank_compensation_is_exact_and_allocation_beats_uniform():
    model = tiny_bert()
    ids, mask = batch()
    lin = select_linears(model, PATTERN)
    stats = collect_input_stats(
        model, lin, [(ids, mask)], forward=lambda m, b: m(input_ids=b[0], attention_mask=b[1]), masks=lambda b: b[1]
    )
    plan = CompensationPlan.build(lin, stats, scaling="qera")
    assert plan.total_rank == sum(min(m.weight.shape) for m in lin.values())
    with pytest.raises(ValueError, match=f"rank budget {plan.total_rank + 1} exceeds the total rank {plan.total_rank}"):
        plan.ranks(plan.total_rank + 1)
    full = plan.ranks(plan.total_rank)
    exact = copy.deepcopy(model)
    layers = quantize_model(exact, PATTERN, adapters=plan.adapters(full), adapter_dtype="float32")
    for n, layer in layers.items():
        torch.testing.assert_close(layer.effective_weight(), lin[n].weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden(exact, ids, mask), hidden(model, ids, mask), rtol=1e-4, atol=1e-4)
    # at a partial budget the load-aware allocation's weighted error is at most the uniform one's,
    # and both are below MXFP4 alone
    zero = {n: 0 for n in lin}
    uni, la = plan.ranks(48, "uniform"), plan.ranks(48, "load_aware")
    assert sum(uni.values()) == sum(la.values()) == 48
    assert plan.weighted_error(la) <= plan.weighted_error(uni) < plan.weighted_error(zero)
    # and the compensated model is closer to the float one than MXFP4 alone
    ref = hidden(model, ids, mask)
    q0, q1 = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(q0, PATTERN)
    quantize_model(q1, PATTERN, adapters=plan.adapters(la))
    assert (hidden(q1, ids, mask) - ref).norm() < (hidden(q0, ids, mask) - ref).norm()


def test_plan_needs_statistics_for_scaled_errors():
    model = tiny_bert()
    lin = select_linears(model, PATTERN)
    with pytest.raises(ValueError, match="need calibration statistics"):
        CompensationPlan.build(lin, None, scaling="qera")
    with pytest.raises(ValueError, match="scaling must be one of"):
        CompensationPlan.build(lin, None, scaling="svd")


def test_output_sensitivity_closed_form_and_no_side_effects():
    from crucible.quant import collect_output_sensitivity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    c = torch.tensor([1.0, -2.0])
    x = torch.randn(5, 4)
    # L = sum_rows c . y2  ->  dL/dy2 = c per row, dL/dy1 = W2^T c per row
    sens = collect_output_sensitivity(model, ["0", "1"], [x], lambda m, b: (m(b) * c).sum())
    assert sens["1"] == pytest.approx(float(c @ c) / 2)
    w2c = model[1].weight.detach().T @ c
    assert sens["0"] == pytest.approx(float(w2c @ w2c) / 3)
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())
    # masked tokens do not count: a (b, t, k) input with half the positions masked out
    seq = torch.randn(2, 4, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    sens = collect_output_sensitivity(
        model, ["1"], [seq], lambda m, b: (m(b) * c * mask[..., None]).sum(), masks=lambda b: mask
    )
    assert sens["1"] == pytest.approx(float(c @ c) / 2)  # every counted token has gradient c
    with pytest.raises(ValueError, match="the loss is nan"):
        collect_output_sensitivity(model, ["1"], [x], lambda m, b: m(b).sum() * float("nan"))
    with pytest.raises(ValueError, match="needs each layer's output sensitivity"):
        CompensationPlan.build({"0": nn.Linear(32, 4)}, None, scaling="plain", load="sensitivity")
    plan = CompensationPlan.build(
        {"a": nn.Linear(32, 4), "b": nn.Linear(32, 4)},
        None,
        scaling="plain",
        load="sensitivity",
        sensitivity={"a": 2.0, "b": 0.5},
    )
    assert plan.layers["a"].load == 2.0 and plan.layers["b"].load == 0.5


def test_mx_embeddings_dequantize_looked_up_rows_and_round_trip(tmp_path):
    from crucible.quant.linear import MXEmbedding, quantize_embeddings

    model = tiny_bert()
    ids, mask = batch()
    table = model.embeddings.word_embeddings.weight.detach().clone()
    with pytest.raises(ValueError, match="matches no nn.Embedding.*word_embeddings"):
        quantize_embeddings(model, r"^decoder")
    quantize_model(model, PATTERN)
    layers = quantize_embeddings(model, r"word_embeddings")
    emb = layers["embeddings.word_embeddings"]
    assert isinstance(model.embeddings.word_embeddings, MXEmbedding) and emb.padding_idx == 0
    assert torch.equal(emb(ids), dequantize(quantize(table))[ids])
    assert emb.nbytes() * 8 / table.numel() == 4.25
    out = hidden(model, ids, mask)
    path = tmp_path / "q.safetensors"
    save_quantized(model, path)
    loaded = load_quantized(path, tiny_bert(seed=5))
    assert isinstance(loaded.embeddings.word_embeddings, MXEmbedding)
    assert torch.equal(hidden(loaded, ids, mask), out)
    from transformers import BertConfig, BertModel

    other = BertModel(
        BertConfig(
            vocab_size=60,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=32,
        )
    )
    with pytest.raises(ValueError, match=r"embedding 'embeddings.word_embeddings' is 50 x 64 in the file"):
        load_quantized(path, other)


def test_cached_dense_weight_gives_the_same_outputs_and_follows_the_buffers():
    """cache_dequantized: one dequantization reused across calls, bit-equal outputs; a changed packed
    buffer (load_state_dict copies in place) invalidates it."""
    from crucible.quant import cache_dequantized

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    model = torch.nn.Sequential(lin)
    quantize_model(model, r"^0$")
    x = torch.randn(5, 64)
    plain = model(x)
    assert cache_dequantized(model) == 1
    assert torch.equal(model(x), plain)
    layer = model[0]
    first = layer._dense_cache[1]
    model(x)
    assert layer._dense_cache[1] is first  # reused, not rebuilt
    other = torch.nn.Sequential(torch.nn.Linear(64, 16))
    quantize_model(other, r"^0$")
    model.load_state_dict(other.state_dict())
    assert torch.equal(model(x), other(x))  # the cache followed the new codes
    cache_dequantized(model, False)
    assert layer._dense_cache is None and torch.equal(model(x), other(x))


def test_the_cache_holds_bfloat16_and_is_exact_for_every_mxfp4_value():
    """The CPU cache keeps 2 bytes per weight (bfloat16) and loses nothing: every MXFP4 value (an
    E2M1 number times a power of two, from the smallest scale 2^-127 to the largest) is a bfloat16,
    so the float32 weight rebuilt from the cache equals the dequantized one bit for bit."""
    from crucible.quant import cache_dequantized, mxfp4

    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 16)
    with torch.no_grad():  # rows spanning the whole exponent range, including subnormal results
        for i, e in enumerate((-140, -127, -126, -100, -20, 0, 20, 100, 126)):
            lin.weight[i] = torch.randn(64) * 2.0**e
    model = torch.nn.Sequential(lin)
    quantize_model(model, r"^0$")
    layer = model[0]
    exact = layer.weight_dequantized(torch.float32)
    x = torch.randn(3, 64)
    plain = model(x)

    def _same(a, b):  # bit for bit; the 2^126 row's sums overflow, and some CPUs' kernels give NaN there
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    cache_dequantized(model)
    _same(model(x), plain)
    cached = layer._dense_cache[1]
    assert cached.dtype == torch.bfloat16 and cached.element_size() == 2
    assert torch.equal(cached.float(), exact)
    q = mxfp4.quantize(torch.randn(8, 64) * 1e-38)  # every code at the smallest scales
    assert torch.equal(mxfp4.dequantize(q).to(torch.bfloat16).float(), mxfp4.dequantize(q))
    with torch.inference_mode():  # through the per-thread scratch buffer: the same outputs
        _same(model(x), plain)
    xg = x.clone().requires_grad_(True)  # with autograd on, the weight is a copy of its own
    model(xg).sum().backward()
    assert torch.allclose(xg.grad, exact.sum(0).expand_as(xg))
    cache_dequantized(model, dtype=torch.float32)  # still available: 4 bytes per weight
    _same(model(x), plain)
    assert layer._dense_cache[1].dtype == torch.float32
