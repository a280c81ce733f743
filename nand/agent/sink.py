"""Where the agent's reports go: the interface between the agent core and outputs.

The agent core (``nand.agent.watch``) calls a :class:`Sink` on the training
thread, at step boundaries only. Every method must return at once: a sink that
does I/O hands the work to a background thread (see ``nand.agent.transport.server_sink``).
Sinks never raise into the training loop; the core still guards each call.
"""

from __future__ import annotations

from typing import Any, Protocol

from nand.events import Alert, Event, FlightWindow, StepSummary


class Sink(Protocol):
    #: Wants the per-step calls, ``heartbeat`` and ``commands`` (a server does).
    #: Local sinks say no, so a run without a server pays nothing per step for
    #: them. A sink without the attribute gets them.
    per_step: bool

    def hello(self, info: dict[str, Any]) -> None:
        """The agent started: identity, versions, device, module table, optimizer."""

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        """A non-finite incident; ``flight`` rides along with the first one."""

    def heartbeat(self, summary: StepSummary) -> None:
        """A periodic step summary."""

    def flight(self, flight: FlightWindow, reason: str) -> None:
        """The flight-recorder window, sent on request (e.g. the server asked)."""

    # Optional, for per-step sinks (a server): ``fingerprint(step, names,
    # values, group)``, a replica fingerprint (``nand.agent.step.fingerprint``).

    def commands(self) -> list[dict[str, Any]]:
        """Commands received from the server since the last call (never blocks)."""

    def bye(self, step: int, reason: str) -> None:
        """A clean exit, so the server can tell a crashed rank from a finished one."""

    def close(self, timeout: float) -> None:
        """Flush within ``timeout`` seconds and release resources."""


class LocalSink:
    """A sink for this process only (the log, a file, the user's callables):
    no per-step calls, no commands; each subclass overrides what it records."""

    per_step = False

    def hello(self, info: dict[str, Any]) -> None:
        pass

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        pass

    def alert(self, alert: Alert) -> None:
        pass

    def heartbeat(self, summary: StepSummary) -> None:
        pass

    def flight(self, flight: FlightWindow, reason: str) -> None:
        pass

    def commands(self) -> list[dict[str, Any]]:
        return []

    def bye(self, step: int, reason: str) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass
