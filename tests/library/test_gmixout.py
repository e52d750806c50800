"""GMixout (crucible.gmixout) on nn.Linear toys: the expectation, where gradients go, the EMA
anchor, the mask period, sparse updates, checkpointed state."""

import copy

import pytest
import torch
from torch import nn

from crucible.gmixout import GMixout, GMixoutConfig, MixLinear, mix_weight

torch.set_num_threads(1)


def toy(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_mix_weight_closed_form_and_expectation():
    g = torch.Generator().manual_seed(0)
    w, u, p = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), 0.7
    mask = torch.rand(4, 3, generator=g) < p
    m = mask.float()
    assert torch.allclose(mix_weight(w, u, mask, p), (m * u + (1 - m) * w - p * u) / (1 - p))
    # the mean of the mixed weights over many masks is w
    draws = 20000
    masks = torch.rand(draws, 4, 3, generator=g) < p
    mean = mix_weight(w.expand(draws, 4, 3), u.expand(draws, 4, 3), masks, p).mean(0)
    # sd of one draw is |w - u| sqrt(p / (1 - p)); 5 standard errors
    tol = 5 * (w - u).abs().max() * (p / (1 - p)) ** 0.5 / draws**0.5
    assert (mean - w).abs().max() < tol
    assert (mean - u).abs().max() > 10 * tol  # the test can tell w from the anchor


def test_wrap_keeps_state_dict_names_and_eval_uses_w():
    model = toy()
    keys = list(model.state_dict())
    gm = GMixout.wrap(model, GMixoutConfig(p=0.5, modules=r"^0$"))
    assert isinstance(model[0], MixLinear) and isinstance(model[2], nn.Linear)
    assert list(model.state_dict()) == keys
    x = torch.randn(8, 6)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # move w away from the anchor
        gm.resample()
        model.eval()
        expected = model[2](torch.relu(x @ model[0].weight.T + model[0].bias))
        assert torch.allclose(model(x), expected)
        model.train()
        assert not torch.allclose(model(x), expected)
    gm.unwrap()
    assert type(model[0]) is nn.Linear and list(model.state_dict()) == keys


def test_pattern_matching_no_linear_raises():
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        GMixout.wrap(toy(), GMixoutConfig(modules="attention"))


def test_gradient_reaches_only_unmasked_elements():
    model = toy()
    gm = GMixout.wrap(model, GMixoutConfig(p=0.6, modules=r"^(0|2)$"))
    gm.begin_step()
    model(torch.randn(16, 6)).pow(2).sum().backward()
    for layer in gm.layers.values():
        assert layer.mask.any() and (~layer.mask).any()
        assert (layer.weight.grad[layer.mask] == 0).all()
        assert (layer.weight.grad[~layer.mask] != 0).float().mean() > 0.5
        assert (layer.bias.grad != 0).any()  # biases are not mixed


def test_unmasked_gradient_is_scaled_by_one_over_one_minus_p():
    torch.manual_seed(1)
    lin = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    lin(x).sum().backward()
    plain_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    layer = MixLinear(lin, 0.75)
    layer.mask[0, 1] = True
    layer(x).sum().backward()
    expected = plain_grad / 0.25
    expected[0, 1] = 0
    assert torch.allclose(layer.weight.grad, expected)


def test_ema_anchor_update_formula():
    model = toy()
    beta = 0.9
    gm = GMixout.wrap(model, GMixoutConfig(p=0.5, anchor="ema", ema_beta=beta, sparse=False, modules=r"^0$"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layer = gm.layers["0"]
    for _ in range(3):
        u_before = layer.anchor.clone()
        gm.begin_step()
        model(torch.randn(8, 6)).sum().backward()
        gm.step(opt)
        opt.zero_grad()
        assert torch.allclose(layer.anchor, beta * u_before + (1 - beta) * layer.weight.detach())
    # the pretrained anchor does not move
    model = toy()
    w0 = model[0].weight.detach().clone()
    gm = GMixout.wrap(model, GMixoutConfig.mixout(p=0.5, modules=r"^0$"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gm.begin_step()
    model(torch.randn(8, 6)).sum().backward()
    gm.step(opt)
    assert torch.equal(gm.layers["0"].anchor, w0) and not torch.equal(model[0].weight, w0)


@pytest.mark.parametrize("period", [1, 3])
def test_mask_changes_exactly_every_k_steps(period):
    model = toy()
    gm = GMixout.wrap(model, GMixoutConfig(p=0.5, period=period, sparse=False, modules=r"^0$"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    masks = []
    for _ in range(3 * period + 1):
        gm.begin_step()
        masks.append(gm.layers["0"].mask.clone())
        model(torch.randn(2, 6)).sum().backward()
        gm.step(opt)
    for t in range(1, len(masks)):
        changed = not torch.equal(masks[t], masks[t - 1])
        assert changed == (t % period == 0), t


def test_sparse_mode_leaves_masked_elements_and_their_adam_state_untouched():
    model = toy()
    gm = GMixout.wrap(model, GMixoutConfig(p=0.5, period=1, sparse=True, modules=r"^0$"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    layer = gm.layers["0"]
    for step in range(4):
        gm.begin_step()
        mask = layer.mask.clone()
        before_w = layer.weight.detach().clone()
        before = {k: v.clone() for k, v in opt.state.get(layer.weight, {}).items() if v.shape == mask.shape}
        model(torch.randn(8, 6)).pow(2).sum().backward()
        gm.step(opt)
        opt.zero_grad()
        assert torch.equal(layer.weight[mask], before_w[mask])
        assert (layer.weight[~mask] != before_w[~mask]).all()
        state = opt.state[layer.weight]
        if step == 0:
            assert (state["exp_avg"][mask] == 0).all() and (state["exp_avg_sq"][mask] == 0).all()
        else:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key][mask], before[key][mask]), key
                assert not torch.equal(state[key][~mask], before[key][~mask]), key


def test_sparse_adamw_with_an_empty_mask_equals_torch_adamw():
    a, b = toy(), toy()
    gm = GMixout.wrap(a, GMixoutConfig(p=0.0, sparse=True, modules=r"^(0|2)$"))
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.05, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(8, 6)
        gm.begin_step()
        a(x).pow(2).sum().backward()
        gm.step(opt_a)
        b(x).pow(2).sum().backward()
        opt_b.step()
        opt_a.zero_grad(), opt_b.zero_grad()
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(va, vb, atol=1e-6), k
    for pa, pb in zip(a.parameters(), b.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(opt_a.state[pa][key], opt_b.state[pb][key], atol=1e-7), key


def test_sparse_mode_needs_adamw():
    model = toy()
    gm = GMixout.wrap(model, GMixoutConfig(p=0.5, sparse=True, modules=r"^0$"))
    gm.begin_step()
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(TypeError, match="AdamW"):
        gm.step(torch.optim.SGD(model.parameters(), lr=0.1))


def test_dense_mode_moves_masked_elements_through_momentum_and_decay():
    # the contrast to the sparse test: without `sparse`, AdamW's momentum and weight decay move them
    model = toy()
    gm = GMixout.wrap(model, GMixoutConfig(p=0.5, period=1, sparse=False, modules=r"^0$"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    layer = gm.layers["0"]
    for _ in range(2):
        gm.begin_step()
        mask = layer.mask.clone()
        before_w = layer.weight.detach().clone()
        model(torch.randn(8, 6)).pow(2).sum().backward()
        gm.step(opt)
        opt.zero_grad()
    assert not torch.equal(layer.weight[mask], before_w[mask])


def test_state_dict_roundtrip_continues_identically():
    def run(model, gm, opt, steps):
        for _ in range(steps):
            gm.begin_step()
            model(torch.ones(4, 6)).pow(2).sum().backward()
            gm.step(opt)
            opt.zero_grad()

    cfg = GMixoutConfig(p=0.5, period=2, anchor="ema", ema_beta=0.5, modules=r"^(0|2)$", seed=3)
    a = toy()
    gm_a = GMixout.wrap(a, cfg)
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.05)
    run(a, gm_a, opt_a, 3)
    b = toy(seed=9)
    gm_b = GMixout.wrap(b, cfg)
    b.load_state_dict(a.state_dict())
    gm_b.load_state_dict(gm_a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.05)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    run(a, gm_a, opt_a, 3)
    run(b, gm_b, opt_b, 3)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert gm_b.step_count == 6
