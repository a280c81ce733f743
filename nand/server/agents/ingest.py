"""The ZeroMQ ingest loop: receive → validate → write a batch → commit → ack.

One ROUTER socket on one daemon thread (ZeroMQ sockets are not thread-safe).
Each turn reads what the socket holds (up to four batches ahead of the
writer), validates every frame with :func:`nand.wire.decode` (bad ones are
counted by reason in ``/metrics``, logged, and otherwise ignored: never a
crash), queues the admitted messages (:mod:`nand.server.agents.backlog`: events
and byes go before the heartbeats queued with them), writes the next batch
(up to ``Settings.max_batch``, fewer when a batch would take more than about
a quarter second) in one transaction
(:func:`nand.server.agents.writer.write_batch`) and only then sends each agent
``{"kind": "ack", "agent": id, "seqs": [...]}``, duplicates included.

Admission (:mod:`nand.server.agents.admission`): every agent id is bound to the run,
rank and connection it introduced itself with; with a token configured, only
a ``hello`` carrying it binds a new agent id, and other messages from unknown
agents get ``{"kind": "reject", "reason": "unauthenticated"}``. Messages that
claim another agent's identity are refused and counted, and so are those of
an agent id another server on the same database holds (:mod:`nand.server.agents.leases`,
renewed from this loop and released when it stops). With a CURVE secret
key, the socket is a CURVE server and only encrypted peers connect.

Commands to agents (``stop``, ``send_flight``): :mod:`nand.server.agents.orders`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict
from typing import Any

import zmq
from sqlalchemy import Engine, text

from nand import wire
from nand.errors import WireError
from nand.runids import run_problem
from nand.server.agents import announce, decoding, gate
from nand.server.agents.admission import Admission
from nand.server.agents.backlog import Backlog, Pace
from nand.server.agents.leases import Leases
from nand.server.agents.orders import Commander
from nand.server.agents.writer import write_batch
from nand.server.analysis import losses
from nand.server.metrics import Metrics
from nand.server.settings import Settings

log = logging.getLogger("nand.server.agents.ingest")

#: What the descriptor gate hears of the ingest socket: each accepted
#: connection, and the end of monitoring (which wakes it at shutdown).
MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_MONITOR_STOPPED

#: Batches of messages the ingest reads ahead of the writer, so that an event
#: can pass the heartbeats queued before it (nand.server.agents.backlog).
BACKLOG_BATCHES = 4

#: What the log says when an agent is refused, by reason.
_REFUSAL_TEXT = {
    "unauthenticated": "no valid token (NAND_TOKEN differs)",
    "identity_mismatch": "its run or rank differs from the one its agent id said hello with",
    "agent_in_use": "its agent id is in use on another live connection (or server)",
    "bad_run": "its run id is not one a run can have (nand.runids: '/', '.' or '..')",
}


class Ingest:
    """The ingest thread. ``start()`` binds and returns the bound endpoint.

    >>> from nand.server.storage.db import make_engine
    >>> from nand.server.storage.migrate import upgrade
    >>> engine = make_engine("sqlite:///:memory:"); upgrade(engine)
    >>> ingest = Ingest(engine, Settings(zmq_bind="tcp://127.0.0.1:*"), Metrics())
    >>> ingest.start().startswith("tcp://127.0.0.1:")
    True
    >>> ingest.stop()
    """

    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.endpoint = ""
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.admission = Admission(
            engine,
            settings.token,
            self._still_connected,
            settings.max_agents_cached,
            Leases(engine, settings.agent_lease_s),
        )
        self._refusals = announce.Refusals()
        #: Loss counts committed here: heartbeats repeating them write nothing.
        self._drops = losses.Committed()
        self._sock: zmq.Socket | None = None
        #: Read and admitted, not yet written: what decides a verdict goes first.
        self.backlog = Backlog(BACKLOG_BATCHES * settings.max_batch, settings.max_batch_bytes)
        self.pace = Pace(settings.max_batch)  # (batches of about a quarter second)
        self.commander = Commander(engine, settings, metrics, self._reply)

    def start(self, timeout: float = 10.0) -> str:
        self._thread = threading.Thread(target=self._run, name="nand-ingest", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the ingest socket did not bind in time")
        if self._error is not None:
            raise self._error
        return self.endpoint

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the thread ---------------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        listener_gate = gate.Gate(
            gate.backlog(gate.descriptor_limit()), self.metrics.listener_paused
        )
        try:
            sock = self._bind(context, listener_gate.backlog)
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            context.term()
            return
        self._sock = sock
        self.admission.leases.server = f"{socket.gethostname()} {self.endpoint}"
        listener_gate.watch(self.endpoint, sock.get_monitor_socket(MONITORED))
        self._ready.set()
        try:
            self._loop(sock)
        finally:
            self.admission.leases.release_all()
            listener_gate.stop(wake=sock.disable_monitor)
            sock.close(linger=1000)
            context.term()

    def _bind(self, context: zmq.Context, backlog: int) -> zmq.Socket:
        sock = context.socket(zmq.ROUTER)
        # Per connection: above an agent's window (256 frames) with room for
        # its replays, and small enough that a flooding peer is held in check.
        sock.setsockopt(zmq.RCVHWM, 2_000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        # Frames a little too large are read and counted (too_large); beyond 4x the
        # limit libzmq drops the connection unread, so no peer can exhaust memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.settings.max_frame_bytes)
        # A send to a connection that is gone fails instead of vanishing: how
        # admission tells a reconnected agent from a second connection.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Peers that vanish without closing TCP are dropped after 15 s of silence.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        # What still comes in once the gate pauses the listener (gate.py).
        sock.setsockopt(zmq.BACKLOG, backlog)
        if self.settings.curve_secret_key:
            sock.curve_secretkey = self.settings.curve_secret_key.encode()
            sock.curve_server = True
        sock.bind(self.settings.zmq_bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("ingest listening on %s", self.endpoint)
        return sock

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stopping.is_set():
            # (with messages queued, only a look: a batch waits to be written)
            frames = self._drain(sock) if poller.poll(0 if self.backlog else 100) else []
            if frames or self.backlog:
                try:
                    self._handle(sock, frames)
                except Exception:  # never let one batch kill the loop
                    log.exception("ingest batch failed; its messages will be resent")
            if self.commander.due():
                self.commander.poll()
            self.admission.leases.renew_if_due()

    def _drain(self, sock: zmq.Socket) -> list[tuple[bytes, bytes]]:
        """As many frames as the backlog has room for (messages and bytes): a
        flood is held in ZeroMQ's bounded queues, not in this list."""
        frames: list[tuple[bytes, bytes]] = []
        size = 0
        recv = sock.recv
        count, room = self.backlog.room()
        while len(frames) < count and size < room:
            # Part by part (a multipart message arrives whole): the identity as bytes
            # (a ROUTER always has a part after it), then each part with its own
            # "more" flag: a third of what recv_multipart costs (it asks the socket).
            try:
                ident = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            part = recv(zmq.NOBLOCK, copy=False)
            while part.more:  # (an agent sends one part: a raw peer may send more)
                part = recv(zmq.NOBLOCK, copy=False)
            payload = part.bytes
            frames.append((ident, payload))
            size += len(payload)
        self.metrics.received(len(frames))
        return frames

    # --- one batch ----------------------------------------------------------

    def _handle(self, sock: zmq.Socket, frames: list[tuple[bytes, bytes]]) -> None:
        """One turn: the frames just read into the backlog, its next batch written."""
        if frames:
            accepted = self._authorised(sock, self._decode_all(frames))
            self.backlog.add(accepted, sum(len(payload) for _, payload in frames))
        accepted = self.backlog.take(self.pace.size())
        if not accepted:
            return
        self.commander.seen(accepted, time.time())
        started = time.perf_counter()
        acked = self._write(accepted)
        if acked:
            self.pace.wrote(len(accepted), time.perf_counter() - started)
        announce.stored(
            m
            for _, m in accepted
            if m["kind"] in announce.ANNOUNCED and (m["agent"], m["seq"]) in acked
        )
        self._ack(sock, accepted, acked)
        self.commander.after_batch(accepted)

    def _decode_all(self, frames: list[tuple[bytes, bytes]]) -> list[tuple[bytes, dict[str, Any]]]:
        """The frames that decode, each with its connection; the others counted."""
        decode, limit = decoding.decode, self.settings.max_frame_bytes
        decoded = []
        for ident, payload in frames:  # (inline: thousands a batch)
            try:
                decoded.append((ident, decode(payload, limit)))
            except WireError as exc:
                self.metrics.rejected(exc.reason)
                log.debug("rejected a frame: %s", exc)
        return decoded

    def _authorised(
        self, sock: zmq.Socket, decoded: list[tuple[bytes, dict[str, Any]]]
    ) -> list[tuple[bytes, dict[str, Any]]]:
        """The messages whose connection may speak for their agent (:mod:`admission`)."""
        self.admission.prepare(m["agent"] for _, m in decoded)
        accepted, replies = [], {}
        # A message like one accepted earlier in this batch (same connection, agent,
        # run and rank) is accepted too: that one bound the agent to all four.
        # Hellos are always asked (a token is checked on each).
        admitted: set[tuple[bytes, str, str, int]] = set()
        for ident, message in decoded:
            key = (ident, message["agent"], message["run"], message["rank"])
            if key in admitted and message["kind"] != "hello":
                accepted.append((ident, message))
                continue
            reason = self.admission.refusal(ident, message)
            if reason is None:
                admitted.add(key)
                accepted.append((ident, message))
                continue
            self.metrics.rejected(reason)
            self._refusals.refused(message, _REFUSAL_TEXT[reason])
            # Answered per agent id: a connection also replays what earlier
            # agents of its rank spooled, and their refusal is not its own.
            if reason == "unauthenticated":
                replies[ident, message["agent"]] = "unauthenticated: a valid token is required"
            elif reason == "bad_run":
                replies[ident, message["agent"]] = f"bad_run: {run_problem(message['run'])}"
        accepted, elsewhere = self.admission.leased(accepted)
        for _, message in elsewhere:  # another server holds the agent id
            self.metrics.rejected("agent_in_use")
            self._refusals.refused(message, _REFUSAL_TEXT["agent_in_use"])
        # Only these two are answered: the agent can do nothing but stop (and says
        # why). Identity refusals are not: see nand.server.agents.admission.
        for (ident, agent), reason in replies.items():
            self._send(sock, ident, {"kind": "reject", "agent": agent, "reason": reason})
        return accepted

    def _still_connected(self, ident: bytes, agent: str) -> bool:
        """Probe a connection with an empty ack: the socket is ROUTER_MANDATORY, so a
        send to a connection that is gone fails at once (EHOSTUNREACH)."""
        if self._sock is None:
            return False
        try:
            self._sock.send_multipart(
                [ident, wire.encode({"kind": "ack", "agent": agent, "seqs": []})], zmq.NOBLOCK
            )
        except zmq.Again:  # up, but its queue is full
            return True
        except zmq.ZMQError:
            return False
        return True

    def _write(self, accepted: list[tuple[bytes, dict[str, Any]]]) -> set[tuple[str, int]]:
        messages = [m for _, m in accepted]
        started = time.time()
        try:
            result = write_batch(self.engine, messages, started, *self._rules(), drops=self._drops)
        except Exception:
            self.metrics.write_error()
            if not self._database_answers():
                log.warning("database unavailable; %d messages not acked", len(messages))
                self.backlog.clear()  # (theirs too: agents resend, in their order)
                self._stopping.wait(0.5)
                return set()
            log.exception("a batch of %d messages failed; storing one by one", len(messages))
            return self._write_one_by_one(messages)
        done = time.time()
        self.metrics.batch(
            kinds=result.kinds,
            duplicates=result.duplicates,
            acked=len(result.acked),
            seconds=done - started,
            lags=[done - m["time"] for m in messages],
        )
        return set(result.acked)

    def _rules(self) -> tuple[float, float]:
        """``write_batch``'s settings: ``lost_after_s``, ``grad_outlier_factor``."""
        return self.settings.lost_after_s, self.settings.grad_outlier_factor

    def _database_answers(self) -> bool:
        try:
            with self.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except Exception:
            return False
        return True

    def _write_one_by_one(self, messages: list[dict[str, Any]]) -> set[tuple[str, int]]:
        """Isolate a message the database refuses: it is acked (dropped) and counted.

        Only while the database answers; if it stops answering, nothing more is
        acked and the agents resend.
        """
        acked: set[tuple[str, int]] = set()
        for message in messages:
            key = (message["agent"], message["seq"])
            try:
                acked.update(write_batch(self.engine, [message], time.time(), *self._rules()).acked)
            except Exception as exc:
                if not self._database_answers():
                    return acked
                self.metrics.rejected("store_error")
                log.error("dropped message %s: the database refused it: %s", key, exc)
                acked.add(key)
        return acked

    def _ack(
        self,
        sock: zmq.Socket,
        accepted: list[tuple[bytes, dict[str, Any]]],
        acked: set[tuple[str, int]],
    ) -> None:
        # Grouped by connection *and* agent: one connection may carry a dead
        # agent's replayed spool besides its own messages.
        per_agent: dict[tuple[bytes, str], list[int]] = defaultdict(list)
        for ident, message in accepted:
            key = (message["agent"], message["seq"])
            if key in acked:
                per_agent[(ident, message["agent"])].append(message["seq"])
                acked.discard(key)
        for (ident, agent), seqs in per_agent.items():
            self._send(sock, ident, {"kind": "ack", "agent": agent, "seqs": seqs})

    def _reply(self, ident: bytes, message: dict[str, Any]) -> None:
        """Send on the ingest socket (the commander runs on this same thread)."""
        if self._sock is not None:
            self._send(self._sock, ident, message)

    def _send(self, sock: zmq.Socket, ident: bytes, message: dict[str, Any]) -> None:
        try:
            sock.send_multipart([ident, wire.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will resend
            log.debug("could not reply to a peer: %s", exc)
