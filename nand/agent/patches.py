"""What nand changes for the whole process, in one place.

Each change is made once per process, :func:`installed` names what is in
place, and each is undone by its own rule:

- ``torch.amp.GradScaler.step`` is wrapped on the class while a watch with an
  optimizer is open (:func:`listen_to_scalers`): when a scaler steps a watched
  optimizer, that watch adopts it (``detect/amp.py``), before the scaler
  unscales or steps anything. Lightning, HF ``Trainer`` and accelerate make
  their own scaler, so this is how nand learns of it. The class is restored
  when the last listening watch is closed or, never closed, garbage
  collected (its model and optimizer gone).
- The pipeline stage's ``forward_one_chunk``/``backward_one_chunk`` and its
  shape inference are wrapped on torch's classes while a watch of a stage's
  module is open (``detect/pipeline.py``): the micro-batch each chunk is.
  Restored when the last such watch is closed.
- ``torch.Tensor.backward`` is wrapped on the class while a watch is open
  (:func:`listen_to_backward`): each watch is told the tensor a backward
  starts from (its loss, ``step/losses.py``), then the backward runs as
  usual. Restored when the last listening watch is closed or collected.
- At interpreter exit (:func:`at_exit`): the reads of deferred watches never
  closed (``step/deferred.py``), then the transport's goodbye and close
  (``transport/server_sink.py``). ``atexit`` runs the handler registered last
  first: the transport registers at import, the flush at its first use, so
  the flush runs first. Never removed (a handler with nothing left to do
  does nothing).
- In a forked child (:func:`after_fork_in_child`): the transport drops the
  parent's sockets and sender thread. Never removed (``os`` cannot).

Imports no torch (the transport uses it, also in ``nand spool replay``).
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

#: id(optimizer) -> the watch's "a scaler steps my optimizer" method, held weakly.
_listeners: dict[int, weakref.WeakMethod[Callable[[Any], None]]] = {}
_original_step: Any = None
#: token -> a watch's "a backward starts from this tensor" method, held weakly.
_backward_listeners: dict[int, weakref.WeakMethod[Callable[[Any], None]]] = {}
_original_backward: Any = None
#: Handlers registered with ``atexit`` / ``os.register_at_fork``, by name.
_at_exit: dict[str, Callable[[], None]] = {}
_after_fork: dict[str, Callable[[], None]] = {}


def installed() -> list[str]:
    """What nand has changed in this process now, e.g. ``["GradScaler.step",
    "at exit: transport"]``."""
    found = ["GradScaler.step"] if _original_step is not None else []
    found += ["Tensor.backward"] if _original_backward is not None else []
    pipeline = sys.modules.get("nand.agent.detect.pipeline")  # (imported with the agent)
    if pipeline is not None and pipeline.installed():
        found.append("pipeline stage chunks")
    found += [f"at exit: {name}" for name in _at_exit]
    return found + [f"after fork: {name}" for name in _after_fork]


def at_exit(name: str, handler: Callable[[], None]) -> None:
    """Run ``handler`` at interpreter exit; registered once per ``name``."""
    if name not in _at_exit:
        _at_exit[name] = handler
        atexit.register(handler)


def after_fork_in_child(name: str, handler: Callable[[], None]) -> None:
    """Run ``handler`` in the child after ``os.fork``; registered once per
    ``name`` (nothing where the platform cannot fork)."""
    if name not in _after_fork and hasattr(os, "register_at_fork"):
        _after_fork[name] = handler
        os.register_at_fork(after_in_child=handler)


def listen_to_scalers(optimizer: Any, adopt: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``adopt(scaler)`` whenever a GradScaler steps ``optimizer``; returns
    the function that stops listening. The wrap comes off the class with the
    last listener: at its ``close``, or once its watch is garbage collected
    (a watch never closed must not leave the class patched for the process)."""
    global _original_step
    if _original_step is None:
        _original_step = _scaler_class().step
        _scaler_class().step = _scaler_step
    key = id(optimizer)
    reference = weakref.WeakMethod(adopt)
    _listeners[key] = reference

    def unlisten() -> None:
        if _listeners.get(key) is reference:  # (not a later watch's of the same optimizer)
            del _listeners[key]
        _restore_when_unheard()

    # Held by weakref's registry, not by the watch: runs when the watch is collected.
    collected = weakref.finalize(getattr(adopt, "__self__", adopt), unlisten)
    collected.atexit = False
    return unlisten


def _scaler_class() -> Any:
    """The class whose ``step`` meets the optimizer (torch.cuda.amp's subclasses it)."""
    import torch

    return torch.amp.GradScaler


def _restore_when_unheard() -> None:
    """Put ``GradScaler.step`` back once no live watch listens."""
    global _original_step
    if any(reference() is not None for reference in list(_listeners.values())):
        return
    _listeners.clear()  # (only watches that are gone)
    if _original_step is not None:
        if _scaler_class().__dict__.get("step") is _scaler_step:
            _scaler_class().step = _original_step
        _original_step = None


def _scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """``GradScaler.step`` while a watch listens: tell it, then step as usual."""
    reference = _listeners.get(id(optimizer))
    adopt = reference() if reference is not None else None
    if adopt is not None:
        adopt(self)  # guarded by the watch: never raises into the loop
    return _original_step(self, optimizer, *args, **kwargs)


def listen_to_backward(told: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``told(tensor)`` before every ``tensor.backward()`` (the loss,
    in a user's loop and in the frameworks'); returns the function that stops
    listening. The wrap comes off the class with the last listener, at its
    ``close`` or once its owner is garbage collected."""
    global _original_backward
    import torch

    if _original_backward is None:
        _original_backward = torch.Tensor.backward
        torch.Tensor.backward = _backward  # type: ignore[method-assign]
    reference = weakref.WeakMethod(told)
    key = id(reference)
    _backward_listeners[key] = reference

    def unlisten() -> None:
        _backward_listeners.pop(key, None)
        _restore_backward_when_unheard()

    collected = weakref.finalize(getattr(told, "__self__", told), unlisten)
    collected.atexit = False
    return unlisten


def _restore_backward_when_unheard() -> None:
    global _original_backward
    if any(reference() is not None for reference in list(_backward_listeners.values())):
        return
    _backward_listeners.clear()
    if _original_backward is not None:
        import torch

        if torch.Tensor.__dict__.get("backward") is _backward:
            torch.Tensor.backward = _original_backward  # type: ignore[method-assign]
        _original_backward = None


def _backward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.backward`` while a watch listens: tell each, then run it."""
    for reference in list(_backward_listeners.values()):
        told = reference()
        if told is not None:
            told(self)  # guarded by the watch: never raises into the loop
    return _original_backward(self, *args, **kwargs)
