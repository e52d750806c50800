"""crucible.hooks.forward_hooks: hooks act inside the block and are gone after it, on every exit."""

import pytest
import torch
from torch import nn

from crucible.hooks import forward_hooks


def no_hooks(*modules):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)


def test_forward_hooks_act_inside_the_block_only():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.Sequential(a, b)
    x = torch.randn(2, 3)
    plain = model(x)
    seen = []
    with forward_hooks([(a, lambda m, args, out: seen.append("a")), (b, lambda m, args, out: out * 0)]) as handles:
        assert len(handles) == 2
        assert torch.equal(model(x), torch.zeros_like(plain))  # a forward hook's return replaces the output
    assert seen == ["a"] and no_hooks(a, b)
    assert torch.equal(model(x), plain)


def test_pre_hooks_with_kwargs_and_prepend():
    lin = nn.Linear(3, 3)
    order = []
    with forward_hooks([(lin, lambda m, args: order.append("first"))], pre=True):
        with forward_hooks(
            [(lin, lambda m, args, kwargs: order.append(("kw", tuple(kwargs))))],
            pre=True,
            with_kwargs=True,
            prepend=True,
        ):
            lin(input=torch.randn(1, 3))
        lin(torch.randn(1, 3))
    assert order == [("kw", ("input",)), "first", "first"]  # prepended: runs before the earlier hook
    assert no_hooks(lin)


def test_hooks_removed_when_the_block_raises():
    lin = nn.Linear(3, 3)

    def boom(m, args, out):
        raise RuntimeError("inside the forward")

    with pytest.raises(RuntimeError, match="inside the forward"), forward_hooks([(lin, boom)]):
        lin(torch.randn(1, 3))
    assert no_hooks(lin)
    with pytest.raises(KeyError), forward_hooks([(lin, lambda m, a: None)], pre=True):
        raise KeyError("in the block")
    assert no_hooks(lin)


def test_a_failed_registration_removes_the_hooks_registered_before_it():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    pairs = [(a, lambda m, args, out: None), (b, lambda m, args, out: None), ("not a module", None)]
    with pytest.raises(AttributeError), forward_hooks(pairs):
        pytest.fail("the block must not run")
    assert no_hooks(a, b)
