"""The server's Prometheus metrics, on ``prometheus_client``.

Each app has its own registry (several servers may share a process: the
tests, the demo), with the process and platform collectors, the ingest
counters, ingest lag and batch time and HTTP request latency as histograms,
and ``nand_runs`` by state, which comes from the database at scrape time, so
it is the same on every server sharing it. Counters are per process, as
Prometheus expects: scrape every server.

Losses the agents reported (:mod:`nand.server.analysis.losses`) come from the database
too, over the same live runs as ``nand_runs``: ``nand_agent_messages_dropped``
by reason and ``nand_runs_with_gaps``. They are gauges (a pruned run takes its
losses with it) labelled by reason only, the known reasons and ``other``:
never by run or rank, whose numbers have no bound; which ranks dropped what
is in the REST API (``/api/runs/{run}/ranks``, the verdict).

>>> m = Metrics()
>>> m.rejected("not_msgpack")
>>> 'nand_messages_rejected_total{reason="not_msgpack"} 1.0' in m.render({"healthy": 2})
True
>>> 'nand_runs{state="healthy"} 2.0' in m.render({"healthy": 2})
True
>>> text = m.render({}, dropped={"spool_full": 1000}, runs_with_gaps=1)
>>> 'nand_agent_messages_dropped{reason="spool_full"} 1000.0' in text
True
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from nand.events import RUN_STATES, WARNING_KINDS
from nand.server.analysis import losses
from nand.server.observe import observe_all
from nand.wire import IDENTITY_REASONS, REASONS

__all__ = ["CONTENT_TYPE", "Metrics"]

#: Why a notification POST failed (nand.server.notify.send.FAILURE_REASONS).
NOTIFY_FAILURES = ("http_status", "timeout", "unreachable")
#: Reasons the server adds to nand.wire.REASONS.
SERVER_REASONS = ("store_error", "unauthenticated", *IDENTITY_REASONS)
#: Agent send → commit: a healthy server stays well under a second.
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The metrics of one server; ``render()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._counters()
        self._histograms()
        self._runs = Gauge("nand_runs", "Runs by state.", ["state"], registry=self.registry)
        self._dropped = Gauge(
            "nand_agent_messages_dropped",
            "Messages the agents of the live runs dropped before a server had them, "
            "by reason (their cumulative counts; unknown reasons as other).",
            ["reason"],
            registry=self.registry,
        )
        self._gappy = Gauge(
            "nand_runs_with_gaps",
            "Live runs with a rank that dropped messages.",
            registry=self.registry,
        )

    def _counters(self) -> None:
        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_text, labels, registry=self.registry)

        self._received = counter("nand_messages_received", "Frames received from agents.")
        self._stored = counter("nand_messages_stored", "Messages stored, by kind.", ("kind",))
        self._rejected = counter(
            "nand_messages_rejected", "Messages rejected, by reason.", ("reason",)
        )
        for reason in (*REASONS, *SERVER_REASONS):
            self._rejected.labels(reason)  # every reason shows, at 0 until it happens
        self._duplicates = counter(
            "nand_messages_duplicate", "Messages received again and acked, not stored."
        )
        self._acked = counter("nand_messages_acked", "Messages acknowledged after commit.")
        self._events = counter("nand_events", "Non-finite events stored.")
        self._write_errors = counter("nand_store_errors", "Batches that failed to commit.")
        self._commands = counter("nand_commands_sent", "Commands sent to agents.")
        self._stream_polls = counter(
            "nand_stream_polls", "Database polls for the event streams (one per interval)."
        )
        self._warnings = Gauge(
            "nand_warnings",
            "Early warnings of a blow-up in the live runs, by kind (nand.server.analysis.alerts).",
            ["kind"],
            registry=self.registry,
        )
        self._listener_paused = Gauge(
            "nand_agent_listener_paused",
            "1 while new agent connections wait for file descriptors (see gate.py).",
            registry=self.registry,
        )
        self._stream_clients = Gauge(
            "nand_stream_clients", "Open event-stream connections.", registry=self.registry
        )
        self._notify_counters()

    def _notify_counters(self) -> None:
        self._notified = Counter(
            "nand_notifications_sent",
            "Notifications delivered to NAND_NOTIFY_URL (nand.server.notify.notifier).",
            registry=self.registry,
        )
        self._notify_failed = Counter(
            "nand_notifications_failed",
            "Notification POSTs that failed and will be retried, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in NOTIFY_FAILURES:
            self._notify_failed.labels(reason)
        self._notify_pending = Gauge(
            "nand_notifications_pending",
            "Notifications in the database not delivered yet (all servers').",
            registry=self.registry,
        )

    def _histograms(self) -> None:
        self._lag = Histogram(
            "nand_ingest_lag_seconds",
            "Agent send to commit, per message.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self._batch_seconds = Histogram(
            "nand_ingest_batch_seconds", "Time to write one batch.", registry=self.registry
        )
        self._requests = Histogram(
            "nand_http_request_duration_seconds",
            "HTTP request latency, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )

    def received(self, n: int) -> None:
        self._received.inc(n)

    def listener_paused(self, paused: bool) -> None:
        self._listener_paused.set(int(paused))

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def batch(
        self,
        *,
        kinds: Mapping[str, int],
        duplicates: int,
        acked: int,
        seconds: float,
        lags: list[float],
    ) -> None:
        for kind, n in kinds.items():
            self._stored.labels(kind).inc(n)
        self._events.inc(kinds.get("event", 0))
        self._duplicates.inc(duplicates)
        self._acked.inc(acked)
        self._batch_seconds.observe(seconds)
        observe_all(self._lag, [max(lag, 0.0) for lag in lags])

    def write_error(self) -> None:
        self._write_errors.inc()

    def command_sent(self) -> None:
        self._commands.inc()

    def stream_poll(self) -> None:
        self._stream_polls.inc()

    def stream_clients(self, n: int) -> None:
        self._stream_clients.set(n)

    def notification_sent(self) -> None:
        self._notified.inc()

    def notification_failed(self, reason: str) -> None:
        self._notify_failed.labels(reason).inc()

    def notifications_pending(self, n: int) -> None:
        self._notify_pending.set(n)

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        self._requests.labels(method, route, str(status)).observe(seconds)

    def render(
        self,
        runs_by_state: Mapping[str, int],
        dropped: Mapping[str, int] | None = None,
        runs_with_gaps: int = 0,
        warnings: Mapping[str, int] | None = None,
    ) -> str:
        """The ``/metrics`` body; ``dropped``: the live runs' losses by reason."""
        for state in RUN_STATES:
            self._runs.labels(state).set(runs_by_state.get(state, 0))
        for reason, count in losses.metric_labels(dropped or {}).items():
            self._dropped.labels(reason).set(count)
        self._gappy.set(runs_with_gaps)
        for kind in WARNING_KINDS:
            self._warnings.labels(kind).set((warnings or {}).get(kind, 0))
        return generate_latest(self.registry).decode()
