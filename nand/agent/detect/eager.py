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
- :class:`EagerForwards` runs one model's compiled parts eagerly for a
  while: the steps probed in full after an incident not made exact
  (``tiers.py``), whose probes compiled code would ignore. The stance is
  global (it would run the rest of your compiled code eagerly too, and it
  is a context, not a span of steps); instead the ``forward`` of each
  compiled part gets an instance attribute that calls it through
  ``torch._dynamo.disable``. Dynamo guards on that attribute, so the
  compiled call is traced once more (a graph break where ``forward`` was)
  and the body runs as plain Python, every hook firing; deleted again, the
  first graph's guards hold and the compiled code runs as before.

Without the stance (torch < 2.6) neither is used: the light mode turns full
while the first compiled call is traced (``compile_switch.py``), said once
in the log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

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


_MISSING = object()
_OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


class EagerForwards:
    """A model's compiled parts, run eagerly from :meth:`start` to
    :meth:`remove` (see the module); a handle among the watch's hooks,
    removed with them. Each module is changed through its own attributes:

    - compiled in place (``module.compile()``): its ``_compiled_call_impl``
      is None meanwhile, so ``module(...)`` calls the plain ``_call_impl``;
    - a ``torch.compile`` wrapper inside the model (a block compiled alone):
      the wrapper's ``forward`` is the module's own ``__call__`` meanwhile;
    - the root, when it ran from compiled code that nand does not hold
      (``torch.compile(model)`` returned a wrapper to your loop): its
      ``forward`` calls the model's through ``torch._dynamo.disable``. Dynamo
      guards on that attribute: the wrapper's code is traced once more, its
      graph breaks there, and the body runs as plain Python. That callable is
      made once and reused, so a later span finds that trace (no recompile)."""

    def __init__(self) -> None:
        self._disabled: tuple[Any, Any] | None = None  # (the root's forward, its wrapper)
        self._set: list[tuple[dict[str, Any], str, Any, Any]] = []  # (vars, name, before, ours)

    def start(self, root: nn.Module, root_compiled: bool) -> bool:
        """Run ``root``'s compiled parts eagerly (``root_compiled``: root ran
        from compiled code). Whether any part does."""
        self.remove()
        for module in root.modules():
            if isinstance(module, _OptimizedModule):
                self._put(vars(module), "forward", module._orig_mod.__call__)
            elif getattr(module, "_compiled_call_impl", None) is not None:
                self._put(vars(module), "_compiled_call_impl", None)
        if root_compiled and getattr(root, "_compiled_call_impl", None) is None:
            forward = root.forward
            if self._disabled is None or self._disabled[0] != forward:
                self._disabled = (forward, _disable(forward))
            self._put(vars(root), "forward", self._disabled[1])
        return bool(self._set)

    def _put(self, namespace: dict[str, Any], name: str, value: Any) -> None:
        self._set.append((namespace, name, namespace.get(name, _MISSING), value))
        namespace[name] = value

    def remove(self) -> None:
        for namespace, name, before, ours in reversed(self._set):
            if namespace.get(name, _MISSING) is not ours:  # (changed by you since: left)
                continue
            if before is _MISSING:
                del namespace[name]
            else:
                namespace[name] = before
        self._set = []
