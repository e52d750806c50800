"""The demo's contamination and Poisson audit design, against their definitions."""

import numpy as np
import pandas as pd
import pytest

from crucible.contamination import (
    build_pool,
    draw_poisson_sample,
    near_duplicate,
    poisson_inclusion_probabilities,
    shuffle_words,
)


def test_uniform_design():
    pi = poisson_inclusion_probabilities(1000, 150)
    assert np.allclose(pi, 0.15)


def test_uncertainty_design_meets_budget_floor_and_cap():
    rng = np.random.default_rng(0)
    u = rng.random(2000) ** 3
    pi = poisson_inclusion_probabilities(2000, 300, u, floor=0.05)
    assert pi.sum() == pytest.approx(300, rel=1e-6)
    assert pi.min() >= 0.05 - 1e-12 and pi.max() <= 1.0
    free = (pi > 0.05 + 1e-9) & (pi < 1 - 1e-9)
    ratio = pi[free] / u[free]  # proportional to u where neither floor nor cap binds
    assert np.allclose(ratio, ratio[0])


def test_design_rejects_impossible_budgets():
    with pytest.raises(ValueError, match="exceeds the audit budget"):
        poisson_inclusion_probabilities(1000, 10, np.ones(1000), floor=0.05)
    with pytest.raises(ValueError, match="audit budget must be in"):
        poisson_inclusion_probabilities(10, 11)


def test_audit_size_within_binomial_tolerance():
    pi = poisson_inclusion_probabilities(5000, 400, np.random.default_rng(1).random(5000), floor=0.02)
    sizes = [draw_poisson_sample(pi, np.random.default_rng(100 + s)).sum() for s in range(20)]
    sd = np.sqrt((pi * (1 - pi)).sum())
    assert all(abs(k - 400) < 4 * sd for k in sizes)
    assert abs(np.mean(sizes) - 400) < 4 * sd / np.sqrt(20)


def _frames(n_target=3000):
    target = pd.DataFrame(
        {
            "text": [f"target item number {i} with several words" for i in range(n_target)],
            "label": np.where(np.arange(n_target) % 2, "a", "b"),
        }
    )
    others = pd.DataFrame({"text": [f"other text {i}" for i in range(500)], "corpus": ["x"] * 250 + ["y"] * 250})
    return target, others


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3, 0.5])
def test_realised_contamination_within_binomial_tolerance(eps):
    target, others = _frames()
    pool, truth = build_pool(
        target,
        others,
        n_pool=2000,
        eps=eps,
        mix={"other_corpora": 1, "boilerplate": 1, "near_duplicate": 1, "shuffled": 1},
        rng=np.random.default_rng(3),
        id_prefix="p",
    )
    realised = 1 - truth["member"].mean()
    assert abs(realised - eps) <= 4 * np.sqrt(eps * (1 - eps) / 2000) + 1e-12
    assert (pool["id"] == truth["id"]).all() and pool["id"].is_unique
    members = truth[truth["member"] == 1]
    assert members["label"].notna().all() and truth.loc[truth["member"] == 0, "label"].isna().all()
    assert set(truth.loc[truth["member"] == 0, "origin"]) <= {
        "other:x",
        "other:y",
        "boilerplate",
        "near_duplicate",
        "shuffled",
    }
    # member texts are target texts, unchanged
    assert pool.loc[truth["member"] == 1, "text"].isin(target["text"]).all()


def test_pool_too_large_for_the_target_is_an_error():
    target, others = _frames(n_target=50)
    with pytest.raises(ValueError, match="needs .* target items but only 50"):
        build_pool(
            target, others, n_pool=200, eps=0.1, mix={"boilerplate": 1}, rng=np.random.default_rng(0), id_prefix="p"
        )


def test_degenerate_text_differs_from_its_source():
    rng = np.random.default_rng(0)
    text = "the quick brown fox jumps over the lazy dog today"
    shuffled = shuffle_words(text, rng)
    assert shuffled != text and sorted(shuffled.split()) == sorted(text.split())
    assert near_duplicate(text, rng) != text
