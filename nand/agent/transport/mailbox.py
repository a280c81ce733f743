"""The hand-off between the training thread and the sender thread.

The training thread appends :class:`Outgoing` messages under a lock and goes
on; the sender thread takes them all at once. The mailbox is bounded: when it
is full a heartbeat makes room by dropping the oldest heartbeat, a message
marked ``keep`` (hello, the first incident, bye) by dropping the oldest
unmarked one, and anything else is dropped itself. Every loss is counted by
reason (``queue_full``, ``spool_full``, ``disk_full``, ``spool_error``,
``too_large``, ``encode_error``, ``rejected``, ``closed``, ``commands_full``)
and reported in the next heartbeat as ``dropped``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class Outgoing:
    """A message before it is encoded (encoding happens on the sender thread)."""

    kind: str
    seq: int
    time: float
    #: The body, or a function that builds it (so a large flight window is
    #: converted to plain data off the training thread).
    body: dict[str, Any] | Callable[[], dict[str, Any]]
    keep: bool = False

    def build_body(self) -> dict[str, Any]:
        return self.body() if callable(self.body) else self.body


class Mailbox:
    """Bounded intake, received commands and loss counters, under one lock."""

    def __init__(self, capacity: int) -> None:
        self.lock = threading.Lock()
        self.capacity = max(1, capacity)
        self.intake: deque[Outgoing] = deque()
        self.commands: list[dict[str, Any]] = []
        self.dropped: dict[str, int] = {}
        #: Messages that left the intake by being dropped (for flush accounting).
        self.intake_drops = 0
        #: Goes up with every loss counted: a heartbeat tells whether the counts
        #: moved without copying them (read without the lock: an int).
        self.drops_version = 0

    def put(self, message: Outgoing) -> bool:
        """Append (caller holds the lock); False if ``message`` itself was dropped."""
        if len(self.intake) >= self.capacity and not self._make_room(message):
            self.count_drop("queue_full")
            self.intake_drops += 1
            return False
        self.intake.append(message)
        return True

    def _make_room(self, message: Outgoing) -> bool:
        victim = self._oldest(lambda m: m.kind == "heartbeat" and not m.keep)
        if victim is None and message.keep:
            victim = self._oldest(lambda m: not m.keep)
        if victim is None:
            return False
        self.intake.remove(victim)
        self.count_drop("queue_full")
        self.intake_drops += 1
        return True

    def _oldest(self, match: Callable[[Outgoing], bool]) -> Outgoing | None:
        return next((m for m in self.intake if match(m)), None)

    def take_all(self) -> list[Outgoing]:
        with self.lock:
            taken = list(self.intake)
            self.intake.clear()
        return taken

    def count_drop(self, reason: str, n: int = 1) -> None:
        """Count a loss (caller holds the lock, or use :meth:`drop`)."""
        if n > 0:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            self.drops_version += 1

    def dropped_counts(self) -> dict[str, int]:
        """A copy of the loss counters, by reason (cumulative)."""
        with self.lock:
            return dict(self.dropped)

    def drop(self, reason: str, n: int = 1) -> None:
        with self.lock:
            self.count_drop(reason, n)

    def add_command(self, command: dict[str, Any], limit: int = 1000) -> None:
        with self.lock:
            if len(self.commands) < limit:
                self.commands.append(command)
            else:
                self.count_drop("commands_full")

    def take_commands(self) -> list[dict[str, Any]]:
        with self.lock:
            taken, self.commands = self.commands, []
        return taken
