"""``nand.watch``: the agent's entry point.

>>> import torch, nand
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with nand.watch(model, opt, on_nonfinite="warn") as watch:
...     for _ in range(3):
...         model(torch.randn(2, 4)).pow(2).mean().backward()
...         opt.step()
...         opt.zero_grad()
>>> watch.step, watch.first
(3, None)

It resolves the settings once (:class:`nand.config.AgentConfig`), opens the
rank's :class:`~nand.agent.output.session.Session` (log line, JSONL file,
server) and makes the :class:`~nand.agent.watch.Watch` that hooks the model.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from nand.agent.detect.names import unwrap_optimizer
from nand.agent.output.hook import EventHook, OnEvent
from nand.agent.output.session import Session
from nand.agent.watch import Watch
from nand.config import AgentConfig

__all__ = ["Watch", "watch"]

log = logging.getLogger("nand")
#: The last watch of each model: a model is watched by one watch at a time. Both
#: held weakly (a watch refers to its model: a strong value would keep both alive).
_watch_of: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Watch]] = weakref.WeakKeyDictionary()


def watch(
    model: nn.Module,
    optimizer: Any = None,
    *,
    on_nonfinite: str | None = None,
    on_warning: str | None = None,
    server: str | None = None,
    run: str | None = None,
    events_file: str | None = None,
    allow_nonfinite: tuple[str, ...] | list[str] = (),
    flight_steps: int | None = None,
    max_events: int | None = None,
    scaler: Any = None,
    log_events: bool = True,
    read_params_every_step: bool | None = None,
    read: str | None = None,
    mode: str | None = None,
    on_stop: Callable[[], None] | None = None,
    on_event: OnEvent | Iterable[OnEvent] | None = None,
) -> Watch:
    """Hook nand into ``model`` (and ``optimizer``); each option: docs/python-api.md.

    Every option left ``None`` comes from its ``NAND_*`` variable
    (``nand.config``), else its default. ``on_event``: a callable (or a list)
    given every incident (a :class:`nand.Event`) and early warning (a
    :class:`nand.Alert`) of this rank, at the step boundary
    (``nand.agent.output.hook``); one that raises is logged once, training goes on.
    """
    hook = EventHook.of(on_event)  # (checked first: a bad one is told before anything is hooked)
    settings = AgentConfig.resolve(
        on_nonfinite=on_nonfinite,
        on_warning=on_warning,
        server=server,
        run=run,
        events_file=events_file,
        flight_steps=flight_steps,
        max_events=max_events,
        log_events=log_events,
        read_params_every_step=read_params_every_step,
        read=read,
        mode=mode,
    )
    session = Session.open(settings)
    if hook is not None and not settings.disabled:
        session.add_sink(hook)  # last: the log, the file and the server have it first
    if optimizer is not None:  # accelerate's, Lightning's, DeepSpeed's wrappers
        optimizer = unwrap_optimizer(optimizer)
    _close_earlier_watch(model)
    made = Watch(
        model,
        optimizer,
        settings=settings,
        session=session,
        allow_nonfinite=tuple(allow_nonfinite),
        scaler=scaler,
        on_stop=on_stop,
    )
    _watch_of[model] = weakref.ref(made)
    return made


def _close_earlier_watch(model: nn.Module) -> None:
    """A model still watched by a watch nobody closed (an exception ended the
    loop it was opened for, and HF's ``Trainer`` calls no callback then) would
    run both watches' hooks on every step, and the old one would judge the
    new training: it is closed first, as if its loop had ended."""
    held = _watch_of.get(model)
    earlier = held() if held is not None else None
    if earlier is None or earlier.closed:
        return
    log.warning(
        "nand: this model is still watched by an earlier nand.watch that was never "
        "closed (an exception ended its loop?); closing it: one watch per model"
    )
    earlier.close("replaced by a new watch")
