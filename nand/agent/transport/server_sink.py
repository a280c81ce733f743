"""The agent on the wire: a :class:`~nand.agent.sink.Sink` that reports to a nand server.

The training thread only appends to a bounded mailbox under a lock
(:mod:`nand.agent.transport.mailbox`); a named daemon thread (:mod:`nand.agent.transport.sender`)
owns the ZeroMQ DEALER socket, encodes, sends, resends, spools to disk
(:mod:`nand.agent.transport.spool`) and reads acks and commands. Files: ``server_sink``
(this API) → ``mailbox`` (hand-off) → ``sender`` (the thread, ``connection`` its socket
options, ``silence`` what it says when nothing gets through) → ``outbox`` (where each
unacknowledged frame is) → ``backlog`` → ``spool`` (disk).

Semantics the server relies on (see :mod:`nand.wire` for the messages):

- each ``ServerSink`` is one agent: a random ``agent`` id, ``seq`` 1, 2, 3...
  assigned when a message is submitted; a resent or replayed frame is the same
  bytes, so ``(agent, seq)`` identifies it for deduplication;
- the server answers ``{"kind": "ack", "agent": id, "seqs": [...]}`` once it
  has committed them (``agent`` may be left out for the connection's own agent);
- a ``command`` (``stop`` at a step, ``send_flight``) is handed to the agent
  core through :meth:`ServerSink.commands`; a ``reject`` makes the agent stop
  sending (counted as dropped ``rejected``);
- ``endpoint`` may list several servers on one database (``NAND_SERVER``'s
  list): the rank starts at its own and moves to the next when its server
  dies (:mod:`nand.agent.transport.failover`);
- the token (``token=`` or ``NAND_TOKEN``) rides in ``hello``; with
  ``NAND_CURVE_SERVER_KEY`` the connection is CURVE-encrypted with a key pair
  the agent makes up.

Losses are counted by reason and sent, cumulative, as ``dropped`` in the
next heartbeat after they change, and again every :data:`DROPPED_REPEAT_S`
(``{"queue_full": n, "spool_full": n, ...}``; reasons in
:mod:`nand.agent.transport.mailbox`). A heartbeat lost on the way is itself
counted, so the counts move again and the next heartbeat carries them.

At a normal interpreter exit without ``bye``, the sink says ``bye`` itself
(reason ``exit``, the last step it saw); after an unhandled exception it does
not, so the server sees the rank as crashed. ``close()`` and interpreter exit
flush within ``NAND_CLOSE_TIMEOUT_S`` (default 2 s) and never hang. A forked
child gets a fresh agent id, no thread and no socket; they are re-created on
its first message, which is preceded by a hello with its pid.

>>> import tempfile
>>> from nand.agent.identity import Identity
>>> me = Identity(run="r1", rank=0, local_rank=0, world_size=1, host="h", pid=1)
>>> sink = ServerSink("tcp://127.0.0.1:1", me, spool_dir=tempfile.mkdtemp())
>>> sink.heartbeat(StepSummary(step=1))
>>> sink.close(timeout=1.0)
>>> sink.dropped()
{}
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nand.agent import patches
from nand.agent.identity import Identity
from nand.agent.transport.frames import Envelope
from nand.agent.transport.mailbox import Mailbox, Outgoing
from nand.agent.transport.sender import Sender
from nand.agent.transport.spool import spool_path
from nand.config import TransportConfig
from nand.endpoints import agent_endpoints
from nand.events import Alert, Event, FlightWindow, StepSummary

log = logging.getLogger("nand.agent.transport")
#: Seconds after which a heartbeat repeats loss counts that have not changed.
DROPPED_REPEAT_S = 60.0
_LIVE: weakref.WeakSet[ServerSink] = weakref.WeakSet()


class ServerSink:
    """Sends this rank's messages (``nand.wire.AGENT_KINDS``) to a server."""

    per_step = True  # heartbeats, and the server's commands

    def __init__(
        self,
        endpoint: str,
        identity: Identity,
        *,
        settings: TransportConfig | None = None,
        **overrides: Any,
    ) -> None:
        """``settings``: as ``nand.watch`` resolved them (default: from the
        environment); ``overrides`` (``token=``, ``queue_max=``...) win."""
        agent_endpoints(endpoint)  # raises ConfigError for a bad one
        self.endpoint = endpoint
        self.identity = identity
        self.settings = (settings or TransportConfig.resolve()).but(**overrides)
        self.token = self.settings.token
        self._closed = False
        self._hello: dict[str, Any] | None = None
        self._said_bye = False
        self._last_step = 0
        self._last_beat_body: dict[str, Any] = {"step": 0}
        self._last_beat_at = time.monotonic()
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        """Fresh per-process state (at start and in a forked child)."""
        self.agent = uuid.uuid4().hex
        self._seq = 0
        self._first_event_sent = False
        self._mailbox = Mailbox(self.settings.queue_max)
        self._sender: Sender | None = None
        self._warned = False
        self._hello_due = False  # a forked child introduces itself before its first message
        self._guard = _Guard(self._log_once)
        #: ``Mailbox.drops_version`` when a heartbeat last carried the loss counts.
        self._drops_sent, self._drops_sent_at = 0, time.monotonic()

    # --- the Sink protocol (training thread; returns at once) ----------------

    def hello(self, info: dict[str, Any]) -> None:
        with self._guard:
            self._hello = dict(info)
            self._submit("hello", self._hello_body, keep=True)

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        with self._guard:
            first = not self._first_event_sent
            self._first_event_sent = True
            self._last_step = max(self._last_step, int(event.step))
            body = {"event": event.to_dict(), "flight": None}
            self._submit("event", _with_flight(body, flight), keep=first)

    def heartbeat(self, summary: StepSummary) -> None:
        with self._guard:
            body = summary.to_dict()
            self._last_step = max(self._last_step, int(summary.step))
            now = time.monotonic()
            lost = self._losses_to_report(now)
            if lost:
                body["dropped"] = lost
            # (the keepalive copies it: a repeat of counts already sent is harmless)
            self._last_beat_body, self._last_beat_at = body, now
            self._put("heartbeat", body)

    def _losses_to_report(self, now: float) -> dict[str, int] | None:
        """The loss counts if they moved since a heartbeat last carried them, or
        that was :data:`DROPPED_REPEAT_S` ago; else None (no copy, no lock)."""
        version = self._mailbox.drops_version
        if version == self._drops_sent and now - self._drops_sent_at < DROPPED_REPEAT_S:
            return None
        self._drops_sent, self._drops_sent_at = version, now
        return self.dropped() or None

    def flight(self, flight: FlightWindow, reason: str) -> None:
        with self._guard:
            self._submit("flight", _with_flight({"reason": reason}, flight))

    def alert(self, alert: Alert) -> None:
        with self._guard:
            self._submit("warning", alert.to_dict())

    def fingerprint(self, step: int, names: list[str], values: list[int], group: list[int]) -> None:
        with self._guard:
            body = {"step": step, "names": names, "values": values, "group": group}
            self._submit("fingerprint", body)

    def commands(self) -> list[dict[str, Any]]:
        try:
            return self._mailbox.take_commands()
        except Exception as exc:
            self._log_once(exc)
            return []

    def bye(self, step: int, reason: str) -> None:
        with self._guard:
            self._said_bye = True
            self._submit("bye", {"step": int(step), "reason": reason}, keep=True)

    def _bye_at_exit(self) -> None:
        """The interpreter exits normally and nobody said bye: say it (last step known).

        Not after an unhandled exception (``sys.last_value`` is set then): no
        bye is how the server tells a crashed rank from a finished one.
        """
        crashed = getattr(sys, "last_value", None) is not None
        if self._hello is not None and not self._said_bye and not crashed:
            self.bye(self._last_step, "exit")

    def close(self, timeout: float | None = None) -> None:
        """Flush for at most ``timeout`` seconds (default ``NAND_CLOSE_TIMEOUT_S``)."""
        try:
            self._close(self.settings.close_timeout_s if timeout is None else timeout)
        except Exception as exc:
            self._log_once(exc)

    # --- beyond the protocol --------------------------------------------------

    def dropped(self) -> dict[str, int]:
        """Messages lost so far, by reason (cumulative)."""
        return self._mailbox.dropped_counts()

    def stats(self) -> dict[str, Any]:
        """Counters for tests and diagnostics (read without locking)."""
        sender = self._sender
        out: dict[str, Any] = {"agent": self.agent, "submitted": self._seq}
        out["dropped"] = self.dropped()
        out["queued"] = len(self._mailbox.intake)
        if sender is not None:
            out.update(sender.stats)
            out.update(connected=sender.connected, mode=sender.mode, rejected=sender.rejected)
            out["memory_frames"] = sender.memory_frames
        return out

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted is acknowledged (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sender = self._sender
            if sender is None:
                return self._seq == 0
            accounted = sender.stats["routed"] + self._mailbox.intake_drops
            if accounted >= self._seq and not sender.has_unacked():
                return True
            sender.wake()
            time.sleep(0.01)
        return False

    # --- internals --------------------------------------------------------------

    def _hello_body(self) -> dict[str, Any]:
        body: dict[str, Any] = self.identity.to_dict()
        body.update(self._hello or {})
        body["pid"] = os.getpid()
        if self.token:
            body["token"] = self.token
        return body

    def _submit(self, kind: str, body: Any, keep: bool = False) -> None:
        with self._guard:
            self._put(kind, body, keep)

    def _put(self, kind: str, body: Any, keep: bool = False) -> None:
        """Number ``body`` and hand it to the sender (caller guards)."""
        wake = keep or kind == "event"
        with self._mailbox.lock:
            if self._closed:
                self._mailbox.count_drop("closed")
                return
            if self._hello_due and kind != "hello":
                self._hello_due = False
                self._seq += 1
                hello = self._hello_body
                at = time.time()
                self._mailbox.put(
                    Outgoing(kind="hello", seq=self._seq, time=at, body=hello, keep=True)
                )
            self._seq += 1
            message = Outgoing(kind=kind, seq=self._seq, time=time.time(), body=body, keep=keep)
            self._mailbox.put(message)
            sender = self._ensure_sender()
            wake = wake or len(self._mailbox.intake) >= self._mailbox.capacity // 2
        if wake:
            sender.wake()

    def _keepalive(self) -> None:
        """On the sender thread: repeat the last heartbeat if training went quiet.

        A rank stuck in an all-reduce stops calling ``heartbeat``; this keeps
        saying "alive, still at step N" so the server reports it *stalled*,
        while a killed rank falls silent and is reported *lost*.
        """
        quiet = time.monotonic() - self._last_beat_at
        if quiet < self.settings.keepalive_s or self._hello is None or self._said_bye:
            return
        self._last_beat_at = time.monotonic()
        body = dict(self._last_beat_body, keepalive=True)
        body.pop("local_grad_norms", None)  # (sent once: they are per step, not a state)
        self._submit("heartbeat", body)

    def _ensure_sender(self) -> Sender:
        """Start the sender thread on first use (again in a forked child)."""
        sender = self._sender
        if sender is not None:
            return sender
        envelope = Envelope(agent=self.agent, run=self.identity.run, rank=self.identity.rank)
        path = spool_path(self.settings.spool_dir, self.identity.run, self.identity.rank)
        sender = Sender(
            self.endpoint, envelope, self._mailbox, self.settings, path, on_idle=self._keepalive
        )
        self._sender = sender
        sender.start()
        return sender

    def _close(self, timeout: float) -> None:
        with self._mailbox.lock:
            if self._closed:
                return
            self._closed = True
            sender = self._sender
        _LIVE.discard(self)
        if sender is None or not sender.is_alive():
            return
        deadline = time.monotonic() + max(0.0, timeout)
        sender.request_stop(deadline)
        # Join a little past the deadline: the thread closes its socket after it.
        sender.join(max(0.0, deadline - time.monotonic()) + 0.2)
        if sender.is_alive():
            log.warning("nand: the sender did not finish within %.1f s; leaving it", timeout)

    def _after_fork_in_child(self) -> None:
        old = self._sender
        self._reset()
        if old is not None:
            old.forget_after_fork()
        # Lazily: a DataLoader worker that never reports starts no thread, opens
        # no socket and never shows up at the server.
        self._hello_due = self._hello is not None

    def _log_once(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("nand: transport error (ignored, training goes on): %r", exc)


class _Guard:
    """``with sink._guard:`` the agent's own errors are logged once and never
    reach the training loop (a class, not ``contextlib.contextmanager``: it is
    entered a few times a message, and a generator costs a microsecond each)."""

    __slots__ = ("_log_once",)

    def __init__(self, log_once: Callable[[BaseException], None]) -> None:
        self._log_once = log_once

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self._log_once(exc)
        return True


if TYPE_CHECKING:
    from nand.agent.sink import Sink

    def _implements_sink(sink: ServerSink) -> Sink:
        return sink  # mypy checks that ServerSink has every method of the Sink protocol


def _with_flight(body: dict[str, Any], flight: FlightWindow | None) -> Any:
    """Convert a (possibly large) flight window on the sender thread, not here."""
    if flight is None:
        return body

    def build() -> dict[str, Any]:
        return {**body, "flight": flight.to_dict()}

    return build


def _close_all_at_exit() -> None:
    sinks = list(_LIVE)
    timeout = max((sink.settings.close_timeout_s for sink in sinks), default=0.0)
    deadline = time.monotonic() + timeout
    for sink in sinks:
        sink._bye_at_exit()
        sink.close(max(0.0, deadline - time.monotonic()))


def _after_fork_in_child() -> None:
    for sink in list(_LIVE):
        try:
            sink._after_fork_in_child()
        except Exception as exc:
            log.warning("nand: could not reset the transport after fork: %r", exc)


patches.at_exit("transport", _close_all_at_exit)
patches.after_fork_in_child("transport", _after_fork_in_child)
