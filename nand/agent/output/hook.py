"""``on_event``: the user's own callables, as one more sink.

``nand.watch(..., on_event=fn)`` calls ``fn(report)`` with

- a :class:`nand.Event` when an incident starts on this rank (the first
  non-finite step, and the next one after finite steps again: what the log
  says, one call per incident, never one per bad step), and
- a :class:`nand.Alert` for each early warning (``loss_spike``,
  ``grad_growth``, ``headroom``), ``isinstance(report, nand.Alert)`` tells them apart.

It runs on the training thread at the step boundary that found it (never
inside a hook, never under the transport's lock), after the log, the JSONL
file and the server's queue have it; keep it quick, or hand slow work to a
thread of your own. A callable that raises is logged once, with its
traceback, and is called again for the next report: training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from nand.agent.sink import LocalSink
from nand.errors import ConfigError
from nand.events import Alert, Event, FlightWindow

log = logging.getLogger("nand")

#: What ``on_event`` is given: an incident or an early warning.
Report = Event | Alert
OnEvent = Callable[[Report], object]


class EventHook(LocalSink):
    """Calls the user's callables with every incident and early warning
    (heartbeats and commands are not theirs)."""

    def __init__(self, callables: list[OnEvent]) -> None:
        self.callables = callables
        self._failed: set[int] = set()  # id() of those that raised: logged already

    @classmethod
    def of(cls, on_event: OnEvent | Iterable[OnEvent] | None) -> EventHook | None:
        """The hook for ``nand.watch``'s ``on_event`` (one callable or several),
        or None without any; :class:`ConfigError` for something not callable."""
        if on_event is None:
            return None
        callables = [on_event] if callable(on_event) else list(on_event)
        for fn in callables:
            if not callable(fn):
                raise ConfigError(
                    f"on_event takes a callable or a list of them, not {type(fn).__name__}"
                )
        return cls(callables) if callables else None

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        self._deliver(event)

    def alert(self, alert: Alert) -> None:
        self._deliver(alert)

    def _deliver(self, report: Report) -> None:
        for fn in self.callables:
            try:
                fn(report)
            except Exception as exc:  # the user's code: never into the training loop
                self._failed_once(fn, exc)

    def _failed_once(self, fn: OnEvent, exc: Exception) -> None:
        if id(fn) in self._failed:
            log.debug("nand: on_event %r failed again (%s)", fn, exc)
            return
        self._failed.add(id(fn))
        log.error(
            "nand: on_event %r raised %s; training goes on (later failures are not logged)",
            fn,
            type(exc).__name__,
            exc_info=exc,
        )
