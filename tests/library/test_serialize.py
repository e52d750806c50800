"""Deterministic safetensors bytes: the same tensors and metadata give the same file."""

import torch
from safetensors import safe_open
from safetensors.torch import load, save

from crucible.serialize import canonical_header, safetensors_bytes


def test_metadata_order_does_not_change_the_bytes(tmp_path):
    tensors = {"b": torch.arange(6.0).view(2, 3), "a": torch.ones(4, dtype=torch.uint8), "c": torch.zeros(1)}
    keys = [f"k{i}" for i in range(12)]
    first = safetensors_bytes(tensors, {k: k.upper() for k in keys})
    second = safetensors_bytes(tensors, {k: k.upper() for k in reversed(keys)})
    assert first == second
    # raw safetensors output is not canonical in general; once canonicalised it is
    assert canonical_header(save(tensors, metadata={k: k.upper() for k in reversed(keys)})) == first
    back = load(first)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    path = tmp_path / "x.safetensors"
    path.write_bytes(first)
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == {k: k.upper() for k in keys}
        assert torch.equal(fh.get_tensor("b"), tensors["b"])
    assert int.from_bytes(first[:8], "little") % 8 == 0  # the header stays 8-byte aligned
