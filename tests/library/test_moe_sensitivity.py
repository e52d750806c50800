"""crucible.moe.sensitivity (the propagation-aware loads) and plan_ranks with those loads, on tiny random
Qwen2-MoE (shared expert), Mixtral and Qwen3-MoE models: the linears' loads equal the dense stage's
output sensitivity, a down_proj's equals the routing-weighted gradient of the experts' output taken
through transformers' own forward, shares and loads are finite and consistent, a matrix no gradient
reaches gets load 0 and no rank, ranks sum to the budget."""

import math

import pytest
import torch
from support.moe_models import clone, tiny_mixtral, tiny_qwen2moe, tiny_qwen3, token_batches
from torch.nn import functional as F

from crucible.moe.compensate import expert_stats, moe_plan, plan_ranks
from crucible.moe.mx_experts import quantize_moe
from crucible.moe.routing import Routes, moe_layers, record_routes
from crucible.moe.sensitivity import output_sensitivity
from crucible.quant.compensate import collect_output_sensitivity

torch.set_num_threads(1)

MODELS = {
    "qwen2moe-shared": lambda: tiny_qwen2moe(seed=2, init=0.1),
    "mixtral": lambda: tiny_mixtral(seed=0, init=0.1),
    "qwen3": lambda: tiny_qwen3(seed=1, init=0.1, mlp_only_layers=(1,)),
}


@pytest.fixture(scope="module")
def batches():
    return token_batches(n=3, batch=2, seq=16, seed=5)


def _summed_nll(model, ids):
    logits = model(ids).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")


@pytest.mark.parametrize("kind", list(MODELS))
def test_linear_loads_equal_the_dense_stage_output_sensitivity(kind, batches):
    model = MODELS[kind]()
    sens = output_sensitivity(model, batches)
    linears = [k for k in sens if ".experts." not in k]
    assert any("self_attn" in k for k in linears)
    if kind == "qwen2moe-shared":
        assert any("shared_expert." in k for k in linears)
    ref = collect_output_sensitivity(model, linears, batches, _summed_nll)
    for k in linears:
        assert sens[k].share == 1.0 and sens[k].rows == 2 * 3 * 16
        assert sens[k].load == pytest.approx(ref[k], rel=1e-6), k
    assert not any(p.grad is not None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_down_proj_load_is_the_routing_weighted_gradient_of_the_experts_output(batches):
    """Through transformers' own experts forward: dL/dy_e,t = w_t,e dL/d(out_t), so the summed squared
    gradient of expert e's down_proj output is sum over its tokens of w_t,e^2 ||dL/d out_t||^2."""
    model = tiny_qwen2moe(seed=3, init=0.1)
    sens = output_sensitivity(model, batches)
    layers = moe_layers(model)
    captured = {n: [] for n in layers}
    grads = {n: [] for n in layers}

    def router_hook(name):
        def fn(module, args, out):
            captured[name].append((out[1].detach(), out[2].detach()))  # (top-k weights, top-k index)

        return fn

    def experts_hook(name):
        def fn(module, args, out):
            out.register_hook(lambda g: grads[name].append(g.detach()))

        return fn

    handles = [b.gate.register_forward_hook(router_hook(n)) for n, b in layers.items()]
    handles += [b.experts.register_forward_hook(experts_hook(n)) for n, b in layers.items()]
    try:
        for ids in batches:
            model.zero_grad(set_to_none=True)
            _summed_nll(model, ids).backward()
    finally:
        for h in handles:
            h.remove()
    for name, block in layers.items():
        w = torch.cat([c[0] for c in captured[name]])
        idx = torch.cat([c[1] for c in captured[name]])
        # one backward per batch, in order: grads[name][i] is batch i's gradient of the experts' output
        g2 = torch.cat([grads[name][i].double().pow(2).sum(-1) for i in range(len(batches))])
        for e in range(block.experts.num_experts):
            tok, pos = torch.where(idx == e)
            expected = float((w[tok, pos].double() ** 2 * g2[tok]).sum())
            got = sens[f"{name}.experts.down_proj.{e}"]
            assert got.rows == tok.numel()
            assert got.energy == pytest.approx(expected, rel=1e-5, abs=1e-12), (name, e)


@pytest.mark.parametrize("kind", list(MODELS))
def test_loads_are_finite_positive_shares_sum_to_top_k_and_load_is_share_times_grad(kind, batches):
    model = MODELS[kind]()
    sens = output_sensitivity(model, batches)
    for name, block in moe_layers(model).items():
        e = block.experts.num_experts
        shares = [sens[f"{name}.experts.gate_up_proj.{j}"].share for j in range(e)]
        assert sum(shares) == pytest.approx(model.config.num_experts_per_tok)
        assert [sens[f"{name}.experts.down_proj.{j}"].rows for j in range(e)] == [
            sens[f"{name}.experts.gate_up_proj.{j}"].rows for j in range(e)
        ]
    for k, s in sens.items():
        assert math.isfinite(s.load) and s.load > 0, k  # every matrix is reached by these random tokens
        assert s.load == pytest.approx(s.share * s.grad, rel=1e-12)
    stats = expert_stats(model, batches, record_routes(model, batches))
    assert set(sens) == set(moe_plan(model, stats).layers)  # the same keys as the plan


def test_a_matrix_no_gradient_reaches_gets_load_zero_and_no_rank(batches):
    model = tiny_qwen2moe(seed=4, init=0.1)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()  # layer 0's q/k/v outputs no longer reach the loss
    routes = record_routes(model, batches)
    sens = output_sensitivity(model, batches, routes)
    dead = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert all(sens[k].load == 0.0 and sens[k].rows > 0 for k in dead)
    assert sens["model.layers.1.self_attn.q_proj"].load > 0
    plan = moe_plan(model, expert_stats(model, batches, routes))
    loads = {k: sens[k].load for k in plan.layers}
    budget = 8 * len(plan.layers)
    prop = plan_ranks(plan, budget, "load_aware", loads)
    assert sum(prop.values()) == budget
    assert all(prop[k] == 0 for k in dead)
    assert all(plan_ranks(plan, budget, "uniform")[k] > 0 for k in dead)
    assert prop != plan_ranks(plan, budget, "load_aware")  # other loads, other ranks
    with pytest.raises(ValueError, match="none for"):
        plan_ranks(plan, budget, "load_aware", {k: v for k, v in loads.items() if k not in dead})


def test_replayed_routes_decide_the_shares_and_an_unrouted_expert_gets_load_zero(batches):
    model = tiny_qwen2moe(seed=5, init=0.1, experts=4, top_k=2)
    recorded = record_routes(model, batches)
    forced = Routes(
        {n: torch.tensor([[0, 1]] * recorded.tokens, dtype=v.dtype) for n, v in recorded.indices.items()},
        recorded.num_experts,
        recorded.top_k,
        recorded.batch_tokens,
    )
    sens = output_sensitivity(model, batches, forced)
    for name in moe_layers(model):
        for e, share in enumerate([1.0, 1.0, 0.0, 0.0]):
            for kind in ("gate_up", "down"):
                s = sens[f"{name}.experts.{kind}_proj.{e}"]
                assert s.share == share and (s.load > 0) == (share > 0)


def test_deterministic_leaves_the_model_unchanged_and_refuses_a_quantized_model(batches):
    model = tiny_qwen2moe(seed=6, init=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a = output_sensitivity(model, batches)
    b = output_sensitivity(model, batches)
    assert {k: (s.energy, s.rows, s.tokens) for k, s in a.items()} == {
        k: (s.energy, s.rows, s.tokens) for k, s in b.items()
    }
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in vars(b.experts) for b in moe_layers(model).values())  # the eager forward is gone
    no_shared = output_sensitivity(model, batches, shared=False, attention=False)
    assert not any("shared_expert" in k or "self_attn" in k for k in no_shared)
    q = clone(model)
    quantize_moe(q)
    with pytest.raises(ValueError, match="pass the float model"):
        output_sensitivity(q, batches)
