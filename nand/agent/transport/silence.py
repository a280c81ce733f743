"""Says so when messages do not reach the server, instead of spooling in silence.

A wrong ``NAND_SERVER`` (nothing listening, a host that does not resolve) or a
wrong token would otherwise leave a run without a word from nand while every
message goes to the spool. So, once: after ``silence_warn_s`` with messages
waiting and no acknowledgement ever received, a warning naming the server,
the spool and the command that replays it; and at exit, what is still on disk
and what was lost, by reason.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("nand.agent.transport")


class Silence:
    def __init__(self, endpoint: str, spool_path: Path, after_s: float) -> None:
        self.endpoint = endpoint
        self.spool_path = spool_path
        self.after_s = after_s
        self.started = time.monotonic()
        self.heard_from_server = False
        self.warned = False

    def heard(self) -> None:
        """An acknowledgement arrived: the server is reachable."""
        self.heard_from_server = True

    def check(self, connected: bool, rejected: str | None, waiting: bool) -> None:
        """On every turn of the sender: warn once if nothing got through yet."""
        if self.heard_from_server or self.warned or not waiting:
            return
        waited = time.monotonic() - self.started
        if waited < self.after_s:
            return
        self.warned = True
        if rejected is not None:
            why = f"the server rejected this agent: {rejected}"
        elif connected:
            why = "connected, but nothing was acknowledged: is that port a nand server?"
        else:
            why = "no connection: is the server running, and NAND_SERVER right?"
        log.warning(
            "nand: nothing has reached the server at %s after %.0f s (%s); messages are "
            "kept in %s; to send them later: %s",
            self.endpoint,
            waited,
            why,
            self.spool_path,
            self.replay_command(),
        )

    def at_exit(self, spooled_bytes: int, lost: dict[str, int]) -> None:
        """When the sender stops: what the server never got."""
        if spooled_bytes:
            log.warning(
                "nand: %d bytes of messages did not reach the server at %s; they are kept in "
                "%s; to send them: %s",
                spooled_bytes,
                self.endpoint,
                self.spool_path,
                self.replay_command(),
            )
        if sum(lost.values()):
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(lost.items()))
            log.warning("nand: %d messages were lost (%s)", sum(lost.values()), reasons)

    def replay_command(self) -> str:
        return f"nand spool replay {self.spool_path} --server {self.endpoint}"
