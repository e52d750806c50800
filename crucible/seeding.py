"""Every seed derived from another one, in one place.

    numpy_rng(seed, task, "split")          # np.random.Generator for (seed, task, purpose)
    derive_seed(seed, task, "finetune")     # an int in [0, 2^31) for (seed, task, stage)
    torch_generator(seed)                   # torch.Generator seeded with seed (with keys: derived)
    stream_seed(seed, "dropout")            # a named random stream of one training run
    epoch_seed(seed, epoch)                 # the batch order of one epoch

The scheme for new code is numpy's SeedSequence over [base, *keys]: `numpy_rng(base, *keys)` is
`np.random.default_rng([base, *keys])` with each str key replaced by its zlib.crc32 (int keys are
used as they are), and `derive_seed(base, *keys)` the first `integers(2**31)` draw of that
generator. Results do not depend on the order in which tasks or stages run, and different keys give
independent streams. Without keys, `numpy_rng(seed)` equals `np.random.default_rng(seed)` and
`torch_generator(seed)` is `torch.Generator().manual_seed(seed)`.

`stream_seed` (blake2b of "<seed>/<stream>") and `epoch_seed` (seed * 1_000_003 + epoch) are two
older schemes, kept as they are because the fine-tune stage's head initialisation, mixout masks,
dropout and batch order are drawn from them: another scheme would change the tiny profile's
artifacts. Use them only for those streams; derive anything new with derive_seed / numpy_rng.
"""

from __future__ import annotations

import hashlib
import operator
import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["derive_seed", "epoch_seed", "numpy_rng", "stream_seed", "torch_generator"]


def _entropy(base, keys: tuple) -> list[int]:
    """[base, *keys] as non-negative ints for np.random.SeedSequence (str keys by their crc32)."""
    words = []
    for i, value in enumerate((base, *keys)):
        what = "base seed" if i == 0 else f"key {i - 1}"
        if isinstance(value, str) and i > 0:
            words.append(zlib.crc32(value.encode()))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"seeding: {what} must be an int{' or a str' if i else ''}, got {value!r}")
        word = operator.index(value)
        if word < 0:
            raise ValueError(f"seeding: {what} must be >= 0, got {word}")
        words.append(word)
    return words


def numpy_rng(base: int, *keys: str | int) -> np.random.Generator:
    """np.random.default_rng([base, *keys]), str keys by their zlib.crc32: one independent generator
    per (base, keys), whatever else is drawn. numpy_rng(seed) == np.random.default_rng(seed)."""
    return np.random.default_rng(_entropy(base, keys))


def derive_seed(base: int, *keys: str | int) -> int:
    """An int seed in [0, 2^31) for (base, *keys): the first integers(2**31) of numpy_rng(base, *keys)."""
    return int(numpy_rng(base, *keys).integers(2**31))


def torch_generator(seed: int, *keys: str | int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed`, or with derive_seed(seed, *keys) when keys
    are given."""
    import torch

    return torch.Generator(device=device).manual_seed(derive_seed(seed, *keys) if keys else seed)


def stream_seed(seed: int, stream: str) -> int:
    """A seed in [0, 2^63) for one named random stream of a run, so that streams seeded from one
    seed (dropout, head, mixout) are not the same sequence of draws."""
    digest = hashlib.blake2b(f"{seed}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch `epoch`'s permutation in a run seeded with `seed`: seed * 1_000_003 + epoch."""
    return seed * 1_000_003 + epoch
