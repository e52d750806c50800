"""Forward hooks that are always removed.

    with forward_hooks([(layer, fn) for layer in layers]):               # module.register_forward_hook
        model(x)
    with forward_hooks(pairs, pre=True, with_kwargs=True):                # register_forward_pre_hook
        model(x)

Every hook is registered in the order of `module_hook_pairs` and removed when the block ends,
normally or by an exception; if a registration itself fails, the hooks registered before it are
removed before the error propagates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["forward_hooks"]


@contextlib.contextmanager
def forward_hooks(
    module_hook_pairs: Iterable[tuple[nn.Module, Callable]],
    pre: bool = False,
    *,
    with_kwargs: bool = False,
    prepend: bool = False,
) -> Iterator[list[RemovableHandle]]:
    """Register `hook` on `module` for each (module, hook) pair: a forward pre-hook if `pre`, else a
    forward hook, with torch's `with_kwargs` and `prepend` options; yields the handles and removes
    every hook on leaving the block, whatever happened inside it."""
    handles: list[RemovableHandle] = []
    try:
        for module, hook in module_hook_pairs:
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            handles.append(register(hook, with_kwargs=with_kwargs, prepend=prepend))
        yield handles
    finally:
        for handle in handles:
            handle.remove()
