"""crucible.moe.routing on tiny random Mixtral / Qwen3-MoE models: recording, replay (forced top-k
sets, combine weights from the current logits), consistency, expert load, hidden-state drift."""

import copy

import pytest
import torch
from support.moe_models import tiny_mixtral, tiny_qwen2moe, tiny_qwen3, token_batches

from crucible.moe.mx_experts import quantize_moe
from crucible.moe.routing import (
    Routes,
    consistency,
    expert_load,
    hidden_drift,
    moe_layers,
    record_routes,
    replay,
    router_renormalises,
)

torch.set_num_threads(1)

MODELS = {
    "mixtral": lambda: tiny_mixtral(seed=0, init=0.1),
    "qwen3": lambda: tiny_qwen3(seed=1, init=0.1, norm_topk_prob=False),
    "qwen3-norm": lambda: tiny_qwen3(seed=2, init=0.1, norm_topk_prob=True),
    "qwen2moe-shared": lambda: tiny_qwen2moe(seed=3, init=0.1),
}


@pytest.fixture(scope="module")
def batches():
    return token_batches(n=3, batch=2, seq=16, seed=3)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, batches):
    """(name, float model, its routes, a quantized copy whose own routes differ)."""
    model = MODELS[request.param]()
    routes = record_routes(model, batches, logits=True)
    qmodel = copy.deepcopy(model)
    quantize_moe(qmodel, attention=True)
    return request.param, model, routes, qmodel


def _perturbed(model, scale=0.5, seed=0):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in moe_layers(other).values():
            w = block.gate.weight
            w.add_(torch.randn(w.shape, generator=g) * scale * w.std())
    return other


def test_moe_layers_finds_every_sparse_block():
    assert list(moe_layers(tiny_mixtral())) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # Qwen3-MoE's dense layer 1 (mlp_only_layers) has no router: not a MoE layer
    assert list(moe_layers(tiny_qwen3(layers=3, mlp_only_layers=(1,)))) == ["model.layers.0.mlp", "model.layers.2.mlp"]
    with pytest.raises(ValueError, match="no MoE layer"):
        moe_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_router_renormalisation_rule():
    assert router_renormalises(tiny_mixtral().model.layers[0].mlp.gate)
    assert not router_renormalises(tiny_qwen3(norm_topk_prob=False).model.layers[0].mlp.gate)
    assert router_renormalises(tiny_qwen3(norm_topk_prob=True).model.layers[0].mlp.gate)
    with pytest.raises(ValueError, match="cannot tell"):
        router_renormalises(torch.nn.Linear(4, 4))


def test_record_keeps_topk_per_token_in_batch_order(case, batches):
    _, model, routes, _ = case
    assert routes.batch_tokens == [b.numel() for b in batches]
    assert routes.top_k == 2 and routes.num_experts == 4
    for name, block in moe_layers(model).items():
        idx = routes.indices[name]
        assert idx.dtype == torch.int16 and idx.shape == (sum(routes.batch_tokens), 2)
    # the same ids the router returns, token by token, batch after batch
    seen = {n: [] for n in routes.layers}
    hooks = [
        b.gate.register_forward_hook(lambda m, a, o, n=n: seen[n].append(o[2])) for n, b in moe_layers(model).items()
    ]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    for n in routes.layers:
        assert torch.equal(torch.cat(seen[n]).to(torch.int16), routes.indices[n])
    # one batch's slice
    part = routes.batch(1)
    assert part.tokens == batches[1].numel()
    assert torch.equal(part.indices[routes.layers[0]], routes.indices[routes.layers[0]][32:64])


def test_replay_forces_the_recorded_sets_and_recomputes_weights(case, batches):
    name, model, routes, qmodel = case
    own = record_routes(qmodel, batches)
    assert min(v["set_agreement"] for v in consistency(routes, own).values()) < 1  # replay has work to do
    renorm = name != "qwen3"
    got = {n: [] for n in routes.layers}

    def capture(n):
        def fn(module, args):
            hidden, index, weights = args
            got[n].append((index.clone(), weights.clone()))

        return fn

    logits = {n: [] for n in routes.layers}
    blocks = moe_layers(qmodel)
    with replay(qmodel, routes) as cursor:
        hooks = [b.experts.register_forward_pre_hook(capture(n)) for n, b in blocks.items()]
        hooks += [
            b.gate.register_forward_hook(lambda m, a, o, n=n: logits[n].append(o[0].detach()))
            for n, b in blocks.items()
        ]
        again = record_routes(qmodel, batches)
        for h in hooks:
            h.remove()
    assert cursor == {n: routes.tokens for n in routes.layers}
    for n in routes.layers:
        assert torch.equal(again.indices[n], routes.indices[n])  # every token, every layer
        index = torch.cat([i for i, _ in got[n]])
        weights = torch.cat([w for _, w in got[n]])
        assert torch.equal(index, routes.indices[n].long())  # what the experts received
        probs = torch.softmax(torch.cat(logits[n]).float(), dim=-1)
        expected = probs.gather(1, index)
        if renorm:
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-7)
        if not renorm:
            assert float(weights.sum(-1).max()) < 1 - 1e-3  # Qwen3 without norm_topk_prob: not renormalised


def test_replaying_own_routes_changes_nothing(case, batches):
    _, model, routes, _ = case
    with torch.no_grad():
        plain = [model(b).logits for b in batches]
        with replay(model, routes):
            forced = [model(b).logits for b in batches]
    for a, b in zip(plain, forced):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_replay_restores_the_router_on_exit_and_on_error(case, batches):
    _, model, routes, qmodel = case
    gates = [b.gate for b in moe_layers(qmodel).values()]
    before = record_routes(qmodel, batches)
    # leaving early (2 of 3 batches) is an error in strict mode, and the hooks are gone anyway
    with pytest.raises(ValueError, match=r"replayed 32 tokens, but the routes recorded 96"):
        with replay(qmodel, routes):
            qmodel(batches[0])
    with pytest.raises(RuntimeError, match="inside"):
        with replay(qmodel, routes):
            raise RuntimeError("inside")
    assert all(len(g._forward_hooks) == 0 for g in gates)
    after = record_routes(qmodel, batches)
    for n in before.layers:
        assert torch.equal(before.indices[n], after.indices[n])


def test_replay_refuses_token_count_and_layer_mismatch(case, batches):
    _, model, routes, qmodel = case
    first = routes.layers[0]
    with pytest.raises(
        ValueError, match=rf"layer '{first}' routes 64 tokens so far \(this call 64\), but the routes recorded 32"
    ):
        with replay(qmodel, routes.batch(0)):
            qmodel(torch.cat([batches[0], batches[1]]))
    with replay(qmodel, routes.batch(0), strict=False):  # a prefix is fine when asked for
        qmodel(batches[0][:1])
    dropped = Routes({k: v for k, v in routes.indices.items() if k != first}, 4, 2, routes.batch_tokens)
    with pytest.raises(ValueError, match=r"routes hold 1 MoE layers .* the model has 2"):
        with replay(qmodel, dropped):
            pass
    with pytest.raises(ValueError, match="routes top-1 of 4"):
        with replay(qmodel, Routes({k: v[:, :1] for k, v in routes.indices.items()}, 4, 1, routes.batch_tokens)):
            pass


def test_consistency_is_one_against_itself_and_lower_when_perturbed(case, batches):
    _, model, routes, _ = case
    again = record_routes(model, batches)
    assert consistency(routes, again) == {n: {"set_agreement": 1.0, "top1_agreement": 1.0} for n in routes.layers}
    other = record_routes(_perturbed(model), batches)
    c = consistency(routes, other)
    assert all(v["set_agreement"] < 1 and v["top1_agreement"] < 1 for v in c.values())
    # brute force
    n = routes.layers[-1]
    a, b = routes.indices[n].tolist(), other.indices[n].tolist()
    assert c[n]["set_agreement"] == sum(set(x) == set(y) for x, y in zip(a, b)) / len(a)
    assert c[n]["top1_agreement"] == sum(x[0] == y[0] for x, y in zip(a, b)) / len(a)


def test_consistency_closed_form_and_errors():
    a = Routes({"l": torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]], dtype=torch.int16)}, 4, 2, [4])
    b = Routes({"l": torch.tensor([[1, 0], [2, 1], [1, 0], [2, 3]], dtype=torch.int16)}, 4, 2, [4])
    assert consistency(a, b) == {"l": {"set_agreement": 0.75, "top1_agreement": 0.5}}
    with pytest.raises(ValueError, match="different layers"):
        consistency(a, Routes({"m": b.indices["l"]}, 4, 2, [4]))
    with pytest.raises(ValueError, match="4 tokens .* vs 2"):
        consistency(a, Routes({"l": b.indices["l"][:2]}, 4, 2, [2]))


def test_expert_load_shares():
    r = Routes(
        {
            "a": torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]], dtype=torch.int16),
            "b": torch.tensor([[1, 2], [1, 2], [1, 2], [1, 2]], dtype=torch.int16),
        },
        4,
        2,
        [1, 3],
    )
    load = expert_load(r)
    assert load.shape == (2, 4)
    assert torch.equal(load, torch.tensor([[1.0, 0.5, 0.25, 0.25], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(load.sum(1), torch.full((2,), 2.0, dtype=torch.float64))


def test_routes_file_round_trip_and_errors(case, tmp_path):
    _, _, routes, _ = case
    path = tmp_path / "routes.safetensors"
    data = routes.save(path)
    assert routes.save() == data  # deterministic bytes
    back = Routes.load(path)
    assert back.layers == routes.layers and back.batch_tokens == routes.batch_tokens
    for n in routes.layers:
        assert torch.equal(back.indices[n], routes.indices[n]) and back.indices[n].dtype == torch.int16
        assert torch.equal(back.logits[n], routes.logits[n])
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{cut.name}.*truncated: tensor '.*\.(index|logits)'"):
        Routes.load(cut)
    with pytest.raises(ValueError, match="expert ids must lie in"):
        Routes({"l": torch.tensor([[0, 4]])}, 4, 2, [1])
    with pytest.raises(ValueError, match=r"indices must be an integer tensor \[3, 2\]"):
        Routes({"l": torch.tensor([[0, 1]])}, 4, 2, [3])
    with pytest.raises(ValueError, match="repeats an expert"):
        Routes({"l": torch.tensor([[1, 1]])}, 4, 2, [1])


def test_hidden_drift_per_layer(case, batches):
    _, model, routes, qmodel = case
    layers = model.config.num_hidden_layers
    same = hidden_drift(model, copy.deepcopy(model), batches)
    assert list(same) == [f"layers.{i}" for i in range(layers)] and all(v == 0.0 for v in same.values())
    drift = hidden_drift(qmodel, model, batches)
    assert all(0 < v < 1 for v in drift.values())
    # brute force on the first layer's output
    with torch.no_grad():
        h = torch.cat([qmodel(b, output_hidden_states=True).hidden_states[1].flatten() for b in batches]).double()
        r = torch.cat([model(b, output_hidden_states=True).hidden_states[1].flatten() for b in batches]).double()
    assert drift["layers.0"] == pytest.approx(float((h - r).norm() / r.norm()), rel=1e-9)
