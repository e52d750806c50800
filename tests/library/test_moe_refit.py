"""crucible.moe.refit.refit_down on tiny random Llamas split into Qwen2-MoEs: the least-squares refit
lowers each block's error against the dense FFN, matches a brute-force lstsq, and is all-or-nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from support.moe_models import tiny_llama
from torch import nn

from crucible.hooks import forward_hooks
from crucible.moe.build import moefy
from crucible.moe.refit import _features, refit_down


def ids(seed: int, n: int = 8, t: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    dense = tiny_llama(seed=3)
    moe, _ = moefy(dense, ids(1), n_experts=4, top_k=1, shared_share=0.25, seed=0)
    return dense, moe


def kl(moe, dense, batch):
    with torch.no_grad():
        p = torch.log_softmax(dense(input_ids=batch).logits.float(), -1)
        q = torch.log_softmax(moe(input_ids=batch).logits.float(), -1)
    return float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean())


def test_refit_lowers_every_layers_error_and_the_models_kl(pair):
    dense, built = pair
    moe = copy.deepcopy(built)
    report = refit_down(moe, dense, ids(1), ridge=1e-3)
    assert [r["layer"] for r in report] == [0, 1]
    assert all(r["after"] < 0.7 * r["before"] for r in report), report
    assert kl(moe, dense, ids(1)) < kl(built, dense, ids(1))
    # only the down projections moved
    changed = {k for k, v in moe.state_dict().items() if not torch.equal(v, built.state_dict()[k])}
    assert changed == {
        f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("experts.down_proj", "shared_expert.down_proj.weight")
    }


def test_the_first_layer_matches_a_brute_force_lstsq(pair):
    dense, built = pair
    moe = copy.deepcopy(built)
    block = moe.model.layers[0].mlp
    seen = []
    with forward_hooks([(block, lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))], pre=True):
        with torch.no_grad():
            moe.model(input_ids=ids(1), use_cache=False)
    x = seen[0]
    with torch.no_grad():
        f = _features(block, x)
        target = dense.model.layers[0].mlp(x).double()
    refit_down(moe, dense, ids(1), ridge=1e-9)  # ~ plain least squares
    expected = torch.linalg.lstsq(f, target).solution.T  # [H, S + E w]
    got = torch.cat(
        [
            block.shared_expert.down_proj.weight.double(),
            block.experts.down_proj.double().permute(1, 0, 2).reshape(expected.shape[0], -1),
        ],
        1,
    )
    assert torch.allclose(f @ got.T, f @ expected.T, atol=1e-4)


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_a_failure_restores_the_weights_and_bad_arguments_are_named(pair):
    dense, built = pair
    moe = copy.deepcopy(built)
    broken = copy.deepcopy(dense)
    broken.model.layers[1].mlp = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        refit_down(moe, broken, ids(1))
    assert all(torch.equal(v, built.state_dict()[k]) for k, v in moe.state_dict().items())
    with pytest.raises(ValueError, match=r"ridge=0"):
        refit_down(moe, dense, ids(1), ridge=0)
    with pytest.raises(ValueError, match=r"calib_ids must be an integer tensor"):
        refit_down(moe, dense, torch.rand(2, 4))
    short = copy.deepcopy(dense)
    short.model.layers = short.model.layers[:1]
    with pytest.raises(ValueError, match=r"2 MoE blocks but the dense model 1 layers"):
        refit_down(moe, short, ids(1))
