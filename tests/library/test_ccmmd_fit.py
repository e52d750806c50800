"""Minimum-CC-MMD fitting: the closed-form gradient, and recovery on contaminated regression."""

import numpy as np
import pytest
import torch

from crucible.ccmmd import contaminated_regression, fit_min_ccmmd, gaussian_kernel_matrix, linear_gaussian_sampler
from crucible.ccmmd.fit import weighted_mmd_loss
from crucible.design import corrected_membership


@pytest.mark.parametrize("paired", [True, False])
def test_blockwise_loss_and_gradient_equal_dense_autograd(paired):
    g = torch.Generator().manual_seed(0)
    zh = torch.randn(40, 3, generator=g, dtype=torch.float64, requires_grad=True)
    z = torch.randn(40, 3, generator=g, dtype=torch.float64)
    w = torch.rand(40, generator=g, dtype=torch.float64) * 1.5 - 0.2  # some negative weights
    v = w.clone() if paired else torch.ones(40, dtype=torch.float64)
    bw = (1.0, 2.0)
    loss = weighted_mmd_loss(zh, z, v, w, bw, paired=paired, block_size=16)
    (g_fast,) = torch.autograd.grad(loss, zh)

    kvv = gaussian_kernel_matrix(zh, zh, bw)
    kvv = kvv - torch.diag(torch.diag(kvv))
    kvw = gaussian_kernel_matrix(zh, z, bw)
    if paired:
        kvw = kvw - torch.diag(torch.diag(kvw))
    d_v = v.sum() ** 2 - (v * v).sum()
    d_vw = v.sum() * w.sum() - ((v * w).sum() if paired else 0.0)
    dense = v @ kvv @ v / d_v - 2 * v @ kvw @ w / d_vw
    (g_dense,) = torch.autograd.grad(dense, zh)
    assert float(loss.detach()) == pytest.approx(float(dense.detach()), rel=1e-5)
    torch.testing.assert_close(g_fast, g_dense, rtol=1e-4, atol=1e-6)


def test_min_ccmmd_recovers_clean_slope_where_least_squares_is_biased():
    d = contaminated_regression(200, 0.3, seed=4)
    x, y, member, beta = d["x"], d["y"], d["member"], d["beta"]
    rng = np.random.default_rng(1)
    s = 1 / (1 + np.exp(-(1.5 * (2 * member - 1) + rng.standard_normal(200))))
    pi = np.full(200, 0.3)
    i = (rng.random(200) < pi).astype(float)
    m = corrected_membership(s, i, member, pi)
    z = torch.as_tensor(np.c_[x, y])
    start = np.linalg.lstsq(np.c_[x, np.ones(200)], y, rcond=None)[0]

    def fit(w):
        params = {
            "beta": torch.tensor(start[:3]),
            "intercept": torch.tensor(start[3]),
            "log_sigma": torch.tensor(0.0, dtype=torch.float64),
        }
        res = fit_min_ccmmd(
            linear_gaussian_sampler(x), params, z, w, (1.0, 2.0, 4.0), noise_shape=(200,), steps=80, lr=0.08
        )
        assert res.losses[-1] < res.losses[0]
        return np.linalg.norm(res.params["beta"].numpy() - beta)

    err_ols = np.linalg.norm(start[:3] - beta)
    err_cc = fit(m)
    err_naive = fit(torch.ones(200, dtype=torch.float64))
    assert err_cc < 0.5 * err_ols and err_cc < 0.5 * err_naive
