"""crucible.seeding: the derived seeds are pinned (the tiny profile's artifacts depend on them)."""

import zlib

import numpy as np
import pytest
import torch

from crucible.seeding import derive_seed, epoch_seed, numpy_rng, stream_seed, torch_generator


def test_finetune_seeds_are_pinned():
    # the fine-tune stage's task seeds at pipeline.seed 0 and the streams drawn from rotten's: any
    # change of scheme changes the tiny profile's models, so it must show up here first
    assert {t: derive_seed(0, t, "finetune") for t in ("bbc", "rotten", "tweets", "debates")} == {
        "bbc": 1886313252,
        "rotten": 475254858,
        "tweets": 501471293,
        "debates": 119931521,
    }
    assert [stream_seed(475254858, s) for s in ("head", "mixout", "dropout")] == [
        2682323381001286466,
        1733669165357794968,
        3924442493593964103,
    ]
    assert [epoch_seed(475254858, e) for e in (0, 3)] == [475254858 * 1_000_003, 475254858 * 1_000_003 + 3]


def test_numpy_rng_is_seed_sequence_over_base_and_crc32_keys():
    assert numpy_rng(0, "bbc", "split").integers(0, 1000, 5).tolist() == [163, 19, 616, 624, 796]
    for seed in (0, 1, 5, 2**31 - 1, 2**40):
        want = np.random.default_rng([seed, zlib.crc32(b"tweets"), zlib.crc32(b"audit")]).random(4)
        assert np.array_equal(numpy_rng(seed, "tweets", "audit").random(4), want)
        # without keys: exactly np.random.default_rng(seed)
        assert np.array_equal(numpy_rng(seed).random(4), np.random.default_rng(seed).random(4))
        assert np.array_equal(numpy_rng(np.int64(seed)).random(4), np.random.default_rng(seed).random(4))
    # int keys are used as they are
    assert np.array_equal(
        numpy_rng(3, "moefy", 2).random(3), np.random.default_rng([3, zlib.crc32(b"moefy"), 2]).random(3)
    )


def test_keys_give_distinct_seeds():
    seeds = {derive_seed(b, *k) for b in range(4) for k in [(), ("a",), ("b",), ("a", "b"), ("b", "a"), ("a", 1)]}
    assert len(seeds) == 4 * 6
    assert all(0 <= s < 2**31 for s in seeds)
    assert derive_seed(7, "rotten", "finetune") == derive_seed(7, "rotten", "finetune")


def test_torch_generator():
    a = torch.rand(5, generator=torch_generator(11))
    assert torch.equal(a, torch.rand(5, generator=torch.Generator().manual_seed(11)))
    keyed = torch_generator(11, "rff")
    assert keyed.initial_seed() == derive_seed(11, "rff") and not torch.equal(torch.rand(5, generator=keyed), a)
    assert torch_generator(2**62).initial_seed() == 2**62  # stream seeds go up to 2^63


@pytest.mark.parametrize(
    "base, keys, error",
    [
        (-1, (), ValueError),
        (True, (), TypeError),
        (1.0, (), TypeError),
        ("3", (), TypeError),
        (0, (-2,), ValueError),
        (0, (1.5,), TypeError),
        (0, (None,), TypeError),
        (0, (False,), TypeError),
    ],
)
def test_bad_seeds_and_keys(base, keys, error):
    with pytest.raises(error, match="seeding: (base seed|key 0) must be"):
        numpy_rng(base, *keys)
