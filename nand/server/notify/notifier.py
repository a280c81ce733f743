"""Notifications: a JSON POST to each ``NAND_NOTIFY_URL`` when a run's attempt
changes state (diverged, replica_mismatch, lost, crashed, stalled, its first
warning of a kind, stopped).

How state changes are found: by a periodic sweep (every ``notify_poll_s``, 5 s),
not at ingest. ``lost`` and ``stalled`` come from the clock with no message to
trigger them, and the other states are decided in several places (the
verdict's correlation, the replicas' comparison, a stop request); the sweep
reads them all through the verdict's own functions
(:mod:`nand.server.notify.detect`), so what is sent is what the dashboard
shows, and ingest does no extra work. What the sweep finds goes into the
``notifications`` table (the outbox), one row per (attempt, state, URL) under a
unique constraint: sent once, kept until delivered, and found again by the
sweep after a restart if the server died before writing it. Delivery
(:mod:`nand.server.notify.send`) claims due rows, POSTs them with a short
timeout and backs off on failure.

Everything runs on one daemon thread (``nand-notify``) with its own database
sessions, and the POSTs on a small pool: a slow or dead receiver never delays
ingest or the REST API. Failures are counted in ``/metrics``
(``nand_notifications_failed_total`` by reason) and logged at most once a
minute.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from sqlalchemy import Engine

from nand.server.metrics import Metrics
from nand.server.notify import send
from nand.server.notify.detect import LOOKBACK_S, NOTIFY_STATES, sweep
from nand.server.settings import Settings

__all__ = ["NOTIFY_STATES", "Notifier"]

log = logging.getLogger("nand.server.notify.notifier")

#: A sweep looks again at runs touched this long before the last one began:
#: ingest stamps a batch before it commits it.
OVERLAP_S = 10.0
#: Most POSTs in flight at once.
POSTERS = 4


class Notifier:
    """The sweep-and-deliver thread of one server; ``start()``, ``stop()``."""

    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nand-notify", daemon=True)
        self._pool = ThreadPoolExecutor(POSTERS, thread_name_prefix="nand-notify-post")
        self._log = OnceAMinute()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Flag, then a bounded join: a POST under way ends within its timeout."""
        self._stopping.set()
        self._thread.join(self.settings.notify_timeout_s + 2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        since = time.time() - LOOKBACK_S
        while not self._stopping.is_set():
            began = time.time()
            try:
                self.turn(since, began)
                since = began - OVERLAP_S
            except Exception as exc:  # the database is away: try again next turn
                self._log.say(f"notifications paused: {type(exc).__name__}: {exc}")
            self._stopping.wait(self.settings.notify_poll_s)

    def turn(self, since: float, now: float) -> None:
        """One sweep for state changes since ``since``, then one round of deliveries."""
        sweep(self.engine, self.settings, since, now)
        lease_s = self.settings.notify_timeout_s + 30.0
        deliveries = send.claim(self.engine, self.settings.notify_urls, lease_s, now)
        if deliveries:
            outcomes = list(self._pool.map(self._post, deliveries))
            send.record(self.engine, outcomes, time.time())
            for outcome in outcomes:
                self._count(outcome)
        self.metrics.notifications_pending(send.pending(self.engine))

    def _post(self, delivery: send.Delivery) -> send.Outcome:
        settings = self.settings
        return send.post(delivery, settings.notify_secret, settings.notify_timeout_s)

    def _count(self, outcome: send.Outcome) -> None:
        if outcome.reason is None:
            self.metrics.notification_sent()
            return
        self.metrics.notification_failed(outcome.reason)
        host = urlsplit(outcome.delivery.url).netloc  # not the path: it may hold a secret
        self._log.say(f"a notification to {host} failed ({outcome.detail}); retrying with backoff")


class OnceAMinute:
    """A warning logged at most once a minute, saying how many it stands for.

    >>> logged = OnceAMinute()
    >>> logged.say("a"), logged.say("b")
    (True, False)
    """

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last = -float("inf")
        self._held = 0

    def say(self, message: str) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return False
        more = f" (and {self._held} more in the last minute)" if self._held else ""
        log.warning("%s%s", message, more)
        self._last, self._held = now, 0
        return True
