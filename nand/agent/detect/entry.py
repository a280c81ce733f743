"""Entry points: a watched module called while no watched ``forward`` runs.

The root's pre-hook checks the data a micro-step starts from. But the model
is often entered elsewhere: Lightning's ``training_step`` normalises the
batch and calls ``self.net(x)``; a custom loop calls a transformer's
embedding, then its encoder. What such a module receives was made outside
every watched module, so a non-finite input is ``input``/``data``, named by
that module, not a value its first layer ``produced``.

Telling an entry point apart costs an integer test: the root and every
container (the modules with a pre-hook) count the forwards running
(``HookState.depth``); a container whose pre-hook finds none running, or a
leaf whose hook finds none, is an entry point. A leaf has no pre-hook: its
inputs are probed in its forward hook, before its output, so they still come
first in the window. Modules entered from inside another do no work more.

Not entry points: the forwards that activation checkpointing runs again in
backward (outside the root's call, inside autograd), and anything under
``torch.compile`` or in slot mode (no depth is kept there, see compiled.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.probes import iter_tensors

#: -1 unless autograd is running a backward on this thread (a checkpoint's recompute).
_graph_task_id = torch._C._current_graph_task_id

ProbeInput = Callable[[ModuleInfo, str, Tensor], None]


def outside_backward() -> bool:
    """Whether no backward runs on this thread: a forward with no watched
    forward around it is then really entered from outside the model."""
    return _graph_task_id() == -1


def probe_inputs(
    probe: ProbeInput, info: ModuleInfo, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> None:
    """Probe every tensor ``info``'s module was called with as its input data
    (``probe`` skips what is not a non-empty float tensor)."""
    if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
        probe(info, "args[0]", args[0])  # most calls: no walk
        return
    for path, t in iter_tensors((args, kwargs or {})):
        probe(info, input_slot(path), t)


def input_slot(path: str) -> str:
    """The name of an input slot: ``args[0]``, ``.input_ids``, ``.batch.x``...

    ``path`` comes from :func:`iter_tensors` over ``(args, kwargs)``: ``[0][i]...``
    for positional arguments, ``[1].name...`` for keyword ones.
    """
    return path[3:] if path.startswith("[1].") else "args" + path[3:]
