"""Compiled code, run eagerly where the light mode needs it.

The light mode hooks the root only (``tiers.py``) and makes an incident
exact by replaying its micro-step with every module probed. A compiled
model defeats both halves as it is: dynamo traces the root's hooks into its
graph, where they can neither hold the inputs a replay needs (RNG states,
autograd nodes: ``rerun/held.py``) nor count micro-steps; and compiled code
ignores the hooks a replay adds after dynamo traced the model.

- :class:`OutsideGraph` wraps the root's two hooks: in compiled code it
  calls the hook through ``torch._dynamo.disable``, so dynamo breaks its
  graph there and the hook runs as plain Python, as in an eager model
  (the root's pre-hook runs before the model's first op and its forward
  hook after its last, so the graph of the model's body stays whole). It
  notes that the model ran compiled (``compiled``).
- :func:`eager_stance` runs a replay under
  ``torch.compiler.set_stance("force_eager")`` (torch >= 2.6), where compiled
  code runs eagerly and every hook added after its trace fires.

Without the stance (torch < 2.6) neither is used: the light mode turns full
while the first compiled call is traced (``compile_switch.py``), said once
in the log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_is_compiling = torch.compiler.is_dynamo_compiling
_disable: Callable[[Callable[..., Any]], Callable[..., Any]] = torch._dynamo.disable

#: Whether this torch can run compiled code eagerly on demand (2.6+).
HAS_STANCE = hasattr(torch.compiler, "set_stance")

#: Said (once) where the stance is missing and a compiled model goes full.
NO_STANCE = (
    f"torch {torch.__version__} has no torch.compiler.set_stance (2.6+), so a compiled "
    "model's steps cannot be replayed eagerly"
)


class OutsideGraph:
    """A root hook that compiled code calls outside its graph (see the module).

    In eager code it is the hook, called with one frame more (once per root
    call, not per module). Made by :func:`outside_graph`."""

    __slots__ = ("_from_graph", "compiled", "hook")

    def __init__(self, hook: Callable[..., None]) -> None:
        self.hook = hook
        #: Set once the root was called from compiled code.
        self.compiled = False
        self._from_graph: Callable[..., None] = _disable(self._called_from_graph)

    @property
    def __name__(self) -> str:  # (the hook's own: what a listing of hooks shows)
        name: str = getattr(self.hook, "__name__", "root_hook")
        return name

    def _called_from_graph(self, *args: Any) -> None:
        self.compiled = True
        self.hook(*args)

    def __call__(self, module: Any, args: Any, other: Any, /) -> None:
        raise NotImplementedError  # (each kind of hook has its own: see below)


# Each kind of hook has a ``__call__`` of its own: after the graph break
# dynamo compiles the frame of that call too (an empty graph), and one code
# object for hooks called with different argument types would be compiled
# again for each.


class _OutsidePre(OutsideGraph):
    __slots__ = ()

    def __call__(self, module: Any, args: Any, kwargs: Any, /) -> None:
        if _is_compiling():  # (a constant to dynamo: the call below breaks its graph)
            return self._from_graph(module, args, kwargs)
        return self.hook(module, args, kwargs)


class _OutsidePost(OutsideGraph):
    __slots__ = ()

    def __call__(self, module: Any, args: Any, output: Any, /) -> None:
        if _is_compiling():  # (as in _OutsidePre)
            return self._from_graph(module, args, output)
        return self.hook(module, args, output)


def outside_graph(
    pre: Callable[..., None], post: Callable[..., None]
) -> tuple[OutsideGraph, OutsideGraph]:
    """The root's forward pre-hook (with kwargs) and forward hook, each
    called outside compiled graphs."""
    return _OutsidePre(pre), _OutsidePost(post)


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """Compiled code runs eagerly inside the block (a replay), where torch can."""
    if not HAS_STANCE or _is_compiling():
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield
