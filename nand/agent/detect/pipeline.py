"""Pipeline parallelism (``torch.distributed.pipelining``): micro-batches and hand-overs.

A pipeline stage runs its part of the model once per micro-batch in forward
and once in backward, in the order its schedule says: GPipe runs every
forward and then every backward, 1F1B interleaves them. Counting root calls
would label every backward with the last forward's micro-step, so nand
learns the micro-batch index from the stage itself: while a watch of a
stage's module is open, ``forward_one_chunk`` and ``backward_one_chunk``
(and the weight pass of split-backward schedules) of torch's stage class
are wrapped (once per process, restored when the last
such watch closes) to mark, in the probe buffer, where each chunk's entries
begin and which micro-batch they are (:class:`Handoff`). The micro-step of
an event is then that index, the same on every stage.

What a stage gets from its neighbours it did not make: the activation the
previous stage sent is the stage's input, the gradient the next stage sent
back is the gradient arriving at its output. A non-finite value first seen
there is ``received`` through the pipeline's send/recv (``step/handoff.py``
turns such a finding into one), never bad input data or the loss's doing.

The stage's first step also runs its module on made-up tensors to learn
the shapes it exchanges (:data:`METADATA_METHODS`): nand's hooks ignore
those calls.

Gradients are read with a real probe per call under a pipeline (no bias
proxy, ``grads.BiasProxy``: it stands for one call per micro-step, and a
stage runs several forwards before their backwards).
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from nand.agent.detect.stage import Handoff
from nand.agent.detect.state import HookState

log = logging.getLogger("nand")

#: The stage class's methods that run one micro-batch (``chunk``).
CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
#: A stage's first step runs its module on made-up tensors (uninitialised
#: memory, NaN as likely as not) to learn the shapes it sends and receives:
#: not the user's step, unseen by nand (torch >= 2.10; older ones: ``_shape_inference``).
METADATA_METHODS = (
    "_forward_metadata_inference",
    "_backward_metadata_inference",
    "_shape_inference",
)


class StageListener:
    """One watch's ear on the stage that runs its root (see the module)."""

    def __init__(self, modules: tuple[nn.Module, ...], state: HookState) -> None:
        self.keys = {id(module) for module in modules}
        self.state = state

    def chunk(self, stage: Any, index: int) -> None:
        """``stage`` starts micro-batch ``index`` (forward or backward)."""
        state = self.state
        try:
            buf = state.buf
            if buf.pipeline is None:
                buf.pipeline = Handoff(int(stage.stage_index), int(stage.num_stages))
                state.pipelined = True  # (no bias proxies from now on)
            buf.pipeline.marks.append((len(buf.sites), int(index)))
        except Exception as exc:
            state.guard.failed(exc, "the pipeline stage's micro-batch")

    def remove(self) -> None:
        """Stop listening (the handle a watch's hooks keep)."""
        for key in self.keys:
            _listeners.pop(key, None)
        if not _listeners:
            _restore()


#: id(stage module) -> its watch's listener, held weakly.
_listeners: dict[int, weakref.ref[StageListener]] = {}
#: (class, method name) -> the method nand wrapped.
_originals: dict[tuple[Any, str], Callable[..., Any]] = {}


def listen(root: nn.Module, model: nn.Module, state: HookState) -> StageListener | None:
    """Learn the micro-batches of the stage that runs ``root`` (or ``model``,
    the wrapper the user watched, e.g. DDP's around it), if the job can
    be a pipeline one (``torch.distributed.pipelining`` imported: a script
    that builds a stage imports it before ``nand.watch``, as a rule); returns
    the handle, or None."""
    targets = _targets()
    if not targets:
        return None
    listener = StageListener((root, model), state)
    for key in listener.keys:
        _listeners[key] = weakref.ref(listener)
    if not _originals:
        for cls, name, wrap in targets:
            _originals[cls, name] = original = vars(cls)[name]
            setattr(cls, name, functools.wraps(original)(wrap(original)))
    return listener


def installed() -> bool:
    """Whether the stage classes are wrapped now."""
    return bool(_originals)


def _targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    """(class, method, wrapper) for each method wrapped (none: not a pipeline job)."""
    if "torch.distributed.pipelining" not in sys.modules:  # (importing it costs seconds)
        return []
    try:
        from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase
    except ImportError:  # a torch without pipelining
        return []
    targets = [(_PipelineStageBase, name, _chunk) for name in CHUNK_METHODS]
    unseen = [name for name in METADATA_METHODS if name in vars(PipelineStage)]
    return targets + [(PipelineStage, name, _unseen) for name in unseen]


def _listener(stage: Any) -> StageListener | None:
    ref = _listeners.get(id(getattr(stage, "submod", None)))
    return ref() if ref is not None else None


def _chunk(original: Callable[..., Any]) -> Callable[..., Any]:
    def run_chunk(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        listener = _listener(stage)
        if listener is not None:
            listener.chunk(stage, chunk)
        return original(stage, chunk, *args, **kwargs)

    return run_chunk


def _unseen(original: Callable[..., Any]) -> Callable[..., Any]:
    def run_unseen(stage: Any, *args: Any, **kwargs: Any) -> Any:
        listener = _listener(stage)
        if listener is None:
            return original(stage, *args, **kwargs)
        guard = listener.state.guard
        was_off, guard.off = guard.off, True  # (every hook of the watch returns at once)
        try:
            return original(stage, *args, **kwargs)
        finally:
            guard.off = was_off

    return run_unseen


def _restore() -> None:
    for (cls, name), original in _originals.items():
        setattr(cls, name, original)
    _originals.clear()
