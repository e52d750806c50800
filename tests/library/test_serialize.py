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


def test_nonfinite_finds_every_nan_and_inf_in_every_float_dtype():
    """The one-reduction check (aminmax) passes only finite tensors; a NaN or an inf anywhere, alone
    or beside the other, is reported with its count and first position, as the masked check did."""
    import pytest

    from crucible.serialize import nonfinite

    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.linspace(-3, 3, 24).reshape(4, 6).to(dtype)
        assert nonfinite(x) is None and nonfinite(x[:0]) is None
        for bad, at, text in (
            (float("nan"), (1, 2), "nan"),
            (float("inf"), (3, 5), "inf"),
            (-float("inf"), (0, 0), "-inf"),
        ):
            y = x.clone()
            y[at] = bad
            assert nonfinite(y) == f"1 NaN or inf values of 24 (first: {text} at {list(at)})", (dtype, bad)
        y = x.clone()
        y[2, 1], y[0, 3] = float("nan"), float("inf")
        assert nonfinite(y).startswith("2 NaN or inf values of 24 (first: inf at [0, 3])")
        assert nonfinite(torch.tensor(float("nan"), dtype=dtype)) == "1 NaN or inf values of 1 (first: nan at [])"
    assert nonfinite(torch.tensor([1, 2])) is None  # not floating: nothing to check
    with pytest.raises(NotImplementedError):  # as before: torch has no finiteness test for this dtype
        nonfinite(torch.zeros(2).to(torch.float8_e4m3fn))


def test_state_digest_names_the_content_not_the_dict():
    """The same weights in another dict (copied, keys in another order, a non-contiguous view) have
    one digest; a flipped bit, a renamed key, another dtype or shape over the same bytes do not."""
    from crucible.serialize import state_digest

    g = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(4, 3, generator=g), "a.bias": torch.randn(3, generator=g), "ids": torch.arange(5)}
    same = {k: state[k].clone() for k in reversed(list(state))}
    same["b.weight"] = state["b.weight"].T.contiguous().T  # same values, column-major memory
    assert not same["b.weight"].is_contiguous()
    assert state_digest(same) == state_digest(state)
    flipped = dict(state, **{"a.bias": state["a.bias"].clone()})
    flipped["a.bias"].view(torch.int32)[1] ^= 1  # the lowest mantissa bit of one value
    renamed = {("c.bias" if k == "a.bias" else k): v for k, v in state.items()}
    reshaped = dict(state, **{"b.weight": state["b.weight"].reshape(3, 4)})
    retyped = dict(state, **{"a.bias": state["a.bias"].view(torch.int32)})
    digests = {state_digest(s) for s in (state, flipped, renamed, reshaped, retyped)}
    assert len(digests) == 5
