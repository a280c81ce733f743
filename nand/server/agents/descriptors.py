"""The server under descriptor pressure: a higher limit, and a log that does not drown.

Every ZeroMQ connection and every HTTP connection holds a file descriptor.
Many systems start processes with a soft limit of 1024 (or less) under a much
higher hard limit, so ``nand server`` raises its soft limit to the hard one
at start. When the descriptors run out anyway, asyncio logs
``socket.accept() out of system resource`` with a traceback at every failed
accept (megabytes a second); :class:`EveryInterval` lets one such line through
per minute, with the number held back, and keeps every other record.
"""

from __future__ import annotations

import logging
import resource
import time

#: The message asyncio logs when accept() fails for want of descriptors.
ACCEPT_FAILED = "socket.accept() out of system resource"

log = logging.getLogger("nand.server")


def raise_descriptor_limit() -> int:
    """Set the soft RLIMIT_NOFILE to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the descriptor limit from %d: %s", soft, exc)
    return soft


class EveryInterval(logging.Filter):
    """Let a record whose message starts with ``prefix`` through once per ``interval_s``.

    >>> f = EveryInterval("boom", interval_s=60.0)
    >>> def record(msg): return logging.LogRecord("asyncio", 40, "", 0, msg, None, None)
    >>> [f.filter(record("boom")), f.filter(record("boom")), f.filter(record("other"))]
    [True, False, True]
    """

    def __init__(self, prefix: str, interval_s: float = 60.0) -> None:
        super().__init__()
        self.prefix = prefix
        self.interval_s = interval_s
        self._last = -interval_s
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held += 1
            return False
        if self._held:
            record.msg = f"{record.msg} ({self._held} more like it in the last minute)"
        self._last, self._held = now, 0
        record.exc_info = None  # the traceback says nothing the line does not
        return True


def quiet_accept_failures() -> None:
    """Install the filter on asyncio's logger (once per process)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, EveryInterval) for f in logger.filters):
        logger.addFilter(EveryInterval(ACCEPT_FAILED))
