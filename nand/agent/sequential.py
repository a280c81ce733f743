"""An exact ``nn.Sequential`` root's forward, without torch's hook machinery per child.

A module with a forward hook is called through the slow path of
``Module._call_impl``: a closure, the global hook tables, every hook dict
walked, an exception handler for "always called" hooks. On CPU that costs
about 6 µs a call, more than the probe the hook makes (an MLP's three hooked
Linears: 18 µs of a 0.57 ms step).

For a child whose only hook is nand's leaf hook, that machinery does nothing
but call ``child.forward(input)`` and then the hook with ``(child, (input,),
output)``. :class:`SequentialForward`, set as the root's ``forward``, does
that itself while it is exactly so; otherwise (another hook on the child, the
child compiled on its own, under ``torch.compile``, ``torch.jit.trace`` or
``torch.fx``, a global module hook) it calls the child as
``nn.Sequential.forward`` would.
Nothing else changes: the same hooks run in the same order with the same
arguments, and they stay registered on the children, so code that calls the
children itself (``checkpoint_sequential``, a pipeline stage, a loop over
``model``) is checked as before.

A deep copy of the root gets ``nn.Sequential``'s own forward (see
:meth:`SequentialForward.__reduce__`); ``close`` removes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

# is_dynamo_compiling: False in eager at the cost of a call (dynamo makes it True)
_is_compiling = torch.compiler.is_dynamo_compiling
_tracing_state = torch._C._get_tracing_state
#: torch's module-wide hook tables: any entry puts every module call on the slow path.
_GLOBAL_HOOKS = (
    torch_module._global_forward_pre_hooks,
    torch_module._global_forward_hooks,
    torch_module._global_backward_pre_hooks,
    torch_module._global_backward_hooks,
)


class SequentialForward:
    """``root.forward`` while watched: ``nn.Sequential.forward``, calling the
    children that carry only nand's leaf hook without ``Module.__call__``."""

    def __init__(
        self, root: nn.Sequential, hooks: dict[nn.Module, tuple[Callable[..., None], int]]
    ):
        self.root = root
        #: child -> (nand's leaf hook on it, the hook's handle id)
        self.hooks = hooks

    def __call__(self, input: Any) -> Any:
        # The children are looked up at every call, as nn.Sequential does: one
        # appended or replaced after watch is called, without a hook of nand's.
        children = self.root._modules.values()
        if (
            _is_compiling()
            or _tracing_state()
            or any(_GLOBAL_HOOKS)
            or not isinstance(input, Tensor)  # (torch.fx traces with proxies)
        ):
            for child in children:  # nn.Sequential.forward
                input = child(input)
            return input
        hooks = self.hooks
        for child in children:
            hooked = hooks.get(child)
            if (
                hooked is not None
                and len(forward_hooks := child._forward_hooks) == 1
                and hooked[1] in forward_hooks
                and not child._forward_pre_hooks
                and not child._backward_hooks
                and not child._backward_pre_hooks
                and child._compiled_call_impl is None
            ):  # Module._call_impl's test for its fast path, and nand's hook the only one
                output = child.forward(input)  # what Module.__call__ does for it
                hooked[0](child, (input,), output)  # (guarded itself; returns None)
                input = output
            else:
                input = child(input)
        return input

    def __reduce__(self) -> tuple[Any, ...]:
        """A deep copy (or pickle) of the root gets ``nn.Sequential.forward``:
        rebuilding it reads ``forward`` from the new root before its
        ``__dict__`` is filled, which finds the class's."""
        return (getattr, (self.root, "forward"))

    def install(self) -> bool:
        """Become the root's ``forward``, unless something else already is."""
        if "forward" in self.root.__dict__:
            return False  # a wrapper of someone else's (accelerate's hooks...)
        self.root.forward = self  # type: ignore[method-assign]
        return True

    def remove(self) -> None:
        """Give the root its own forward back. A shallow copy of the root may
        still hold this object: it then calls each child as usual, and keeps
        nothing of the watch alive."""
        self.hooks = {}
        if self.root.__dict__.get("forward") is self:
            del self.root.__dict__["forward"]
