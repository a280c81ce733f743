"""Local sinks: the log (one clear message per incident) and a JSONL file.

Both implement :class:`nand.agent.sink.Sink`. The log is what a person sees
first, so it gets one message per incident, never a flood: the core only
calls ``event`` when an incident *starts* (see ``watch.py``). The JSONL file
is written by a daemon thread, so the training thread never waits on disk.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from typing import Any

from nand import cadence
from nand.agent.sink import LocalSink
from nand.config import TransportConfig
from nand.events import Alert, Event, FlightWindow, finite_or_none

log = logging.getLogger("nand")

_FLOAT_FIELDS = ("min", "max", "max_abs")


class LogSink(LocalSink):
    """Logs incidents through the ``nand`` logger (WARNING) and nothing else."""

    def hello(self, info: dict[str, Any]) -> None:
        log.debug("nand: watching %d modules on rank %s", len(info["modules"]), info["rank"])

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        log.warning("nand: %s", event.message or event.describe())

    def alert(self, alert: Alert) -> None:
        log.warning("nand: rank %d: %s", alert.rank, alert.message)


def event_json(event: Event) -> dict[str, Any]:
    """The event as a JSON-safe dict (NaN/inf figures become null)."""
    data = event.to_dict()
    for key in _FLOAT_FIELDS:
        data[key] = finite_or_none(data[key])
    return data


class JsonlSink(LocalSink):
    """Appends one JSON object per line: events, and hello/bye records.

    ``path`` may contain ``{rank}``. Lines look like
    ``{"type": "event", "event": {...}, "flight": {...} | null}``.
    """

    def __init__(self, path: str, rank: int = 0) -> None:
        self.path = path.replace("{rank}", str(rank))
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="nand-jsonl", daemon=True)
        self._thread.start()

    def hello(self, info: dict[str, Any]) -> None:
        self._queue.put({"type": "hello", **info})

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        record: dict[str, Any] = {"type": "event", "event": event_json(event)}
        record["flight"] = flight.to_dict() if flight is not None else None
        self._queue.put(record)

    def alert(self, alert: Alert) -> None:
        self._queue.put({"type": "warning", "warning": alert.to_dict()})

    def flight(self, flight: FlightWindow, reason: str) -> None:
        self._queue.put({"type": "flight", "reason": reason, "flight": flight.to_dict()})

    def bye(self, step: int, reason: str) -> None:
        self._queue.put({"type": "bye", "step": step, "reason": reason})

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _write_loop(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        while True:
            record = self._queue.get()
            if record is None:
                return
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record, allow_nan=False, default=str) + "\n")
            except (OSError, ValueError) as exc:
                log.error("nand: cannot write %s: %s", self.path, exc)


def server_sink(endpoint: str, identity: Any, settings: TransportConfig) -> Any | None:
    """The transport to the nand server, or None (logged once) if unavailable."""
    try:
        from nand.agent.transport.server_sink import ServerSink  # (pyzmq: the agent extra)
    except ImportError as exc:
        log.error("nand: cannot report to %s (%s); going on without the server", endpoint, exc)
        return None
    # The keepalive (two heartbeat periods) follows a big job's slower heartbeats
    # (nand.cadence), as the server's lost threshold does.
    pace = cadence.stretch(settings.keepalive_s / 2, int(getattr(identity, "world_size", 1)))
    settings = settings.but(keepalive_s=settings.keepalive_s * pace)
    try:
        return ServerSink(endpoint, identity, settings=settings)
    except Exception as exc:  # a bad endpoint must not stop training
        log.error("nand: cannot connect to %s (%s); going on without the server", endpoint, exc)
        return None
