"""The sender thread: owns the ZeroMQ DEALER socket; the outbox decides what to send.

Each turn of the loop: wait for the socket, a wake-up or the poll interval;
read the connection state from the socket's monitor (handshake succeeded /
disconnected; ``ZMQ_IMMEDIATE`` keeps frames from being queued to a
connection that is not up); read acks and commands; encode what the training
thread handed over; then let the :class:`~nand.agent.transport.outbox.Outbox`
resend, spool and send (its docstring tells where each frame is, and in what
order they go).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from nand import wire
from nand.agent.transport import connection
from nand.agent.transport.backlog import Backlog
from nand.agent.transport.failover import Failover
from nand.agent.transport.frames import Envelope, Frame, outgoing_message
from nand.agent.transport.mailbox import Mailbox, Outgoing
from nand.agent.transport.outbox import Outbox
from nand.agent.transport.silence import Silence
from nand.config import TransportConfig
from nand.endpoints import agent_endpoints
from nand.errors import WireError

log = logging.getLogger("nand.agent.transport")
_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED
_FAIL_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class Sender(threading.Thread):
    def __init__(
        self,
        endpoint: str,
        envelope: Envelope,
        mailbox: Mailbox,
        settings: TransportConfig,
        spool_path: Path,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        """``endpoint``: one ZeroMQ endpoint, or several (``NAND_SERVER``'s list;
        this rank starts at its own, see :mod:`nand.agent.transport.failover`)."""
        super().__init__(name=f"nand-sender-{envelope.rank}", daemon=True)
        #: Called on every turn of the loop, on this thread (the sink's keepalive).
        self.on_idle = on_idle
        self.endpoint = endpoint
        self.failover = Failover(agent_endpoints(endpoint), envelope.rank)
        self.envelope = envelope
        self.mailbox = mailbox
        self.settings = settings
        self.spool_path = spool_path
        self.stats = {"routed": 0, "sent": 0, "acked": 0, "spooled": 0, "replayed": 0, "resends": 0}
        self.connected = False
        self.rejected: str | None = None
        self._stop_at: float | None = None
        self._warned: set[str] = set()
        self.backlog = Backlog(
            spool_path, envelope.agent, settings.spool_max_bytes, mailbox, self._warn
        )
        self.outbox = Outbox(envelope.agent, settings, self.backlog, mailbox, self.stats)
        self.silence = Silence(endpoint, spool_path, settings.silence_warn_s)
        self._grace_until = time.monotonic() + settings.connect_grace_s
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.ctx: zmq.Context[Any] | None = None

    # --- called from other threads ------------------------------------------

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full pipe: already awake; closed: gone
            os.write(self._wake_w, b"!")

    def request_stop(self, deadline: float) -> None:
        self._stop_at = deadline
        self.wake()

    def forget_after_fork(self) -> None:
        """In a forked child: close inherited descriptors, touch nothing else."""
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.backlog.forget_after_fork()

    @property
    def memory_frames(self) -> int:
        return self.outbox.memory_frames

    @property
    def mode(self) -> str:
        return self.outbox.mode

    def has_unacked(self) -> bool:
        return self.outbox.has_unacked()

    # --- the thread ---------------------------------------------------------

    def run(self) -> None:
        try:
            self._setup()
        except Exception as exc:
            self._warn("setup", f"nand: the sender could not start ({exc}); messages are dropped")
            self._close_pipe()
            return
        while True:
            try:
                if self._step():
                    break
            except Exception as exc:  # never die silently; never spin either
                self._warn(type(exc).__name__, f"nand: sender error (continuing): {exc!r}")
                time.sleep(0.05)
        self._teardown()

    def _setup(self) -> None:
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._open(self.failover.current)
        if self.backlog.adopt_orphans(self.envelope.rank):
            self.outbox.mode = "spool"

    def _open(self, endpoint: str) -> None:
        """A socket connected to ``endpoint``, and its monitor, both polled."""
        assert self.ctx is not None
        self.sock = connection.dealer(
            self.ctx,
            endpoint,
            curve_server_key=self.settings.curve_server_key,
            immediate=True,
            sndhwm=self.settings.window * 2,
        )
        self.monitor = self.sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS | _FAIL_EVENTS)
        self.sock.connect(endpoint)
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def _close_socket(self) -> None:
        with contextlib.suppress(Exception):
            self.poller.unregister(self.sock)
            self.poller.unregister(self.monitor)
        with contextlib.suppress(Exception):
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)

    def _step(self) -> bool:
        """One turn of the loop; True when the thread should end."""
        self._poll(self._poll_timeout())
        self._read_monitor()
        if self.failover.due(self.connected, self.outbox.failures):
            self._move_on()
        self._read_incoming()
        self._route(self.mailbox.take_all())
        self.outbox.check_deadlines(self.connected, self._grace_until)
        self._pump()
        self.outbox.settle()
        self.silence.check(self.connected, self.rejected, self.outbox.has_unacked())
        if self.on_idle is not None and self._stop_at is None:
            self.on_idle()
        return self._stop_at is not None

    def _poll_timeout(self) -> float:
        timeout = self.settings.poll_interval_s
        deadline = self.outbox.oldest_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        return timeout

    def _poll(self, timeout: float) -> None:
        for fd, _ in self.poller.poll(int(timeout * 1000)):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)

    # --- connection state and incoming messages -----------------------------

    def _read_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event & _UP_EVENTS:
                self.connected = True
                self.outbox.reconnected()
            elif event & _DOWN_EVENTS and self.connected:
                self.connected = False
                self.outbox.to_spool()
            elif event & _FAIL_EVENTS:
                self._warn("handshake", f"nand: handshake with {self.failover.current} failed")

    def _move_on(self) -> None:
        """Leave a server judged dead for the next in the list; what it did not
        acknowledge is resent there (from the spool, as after a reconnect). A new
        socket: no event or ack of the old connection can be taken for the new one's."""
        old = self.failover.current
        self._close_socket()
        new = self.failover.advance()
        self._open(new)
        self.connected = False
        self.outbox.failures = 0
        self.outbox.to_spool()
        self.stats["failovers"] = self.failover.moves
        said = f"nand: the server at {old} does not answer; reporting to {new} now"
        self._warn(f"failover {new}", said)  # once per server: all down, it cycles

    def _read_incoming(self) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = wire.decode(frame)
            except WireError as exc:
                self._warn("bad_reply", f"nand: ignoring a bad message from the server: {exc}")
                continue
            self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message["kind"]
        if kind == "ack":
            agent = message.get("agent") or self.outbox.inflight_agent() or self.envelope.agent
            self.outbox.acked(agent, message["seqs"])
            self.silence.heard()
        elif kind == "command":
            self.mailbox.add_command({k: v for k, v in message.items() if k != "v"})
        elif kind == "reject":
            agent = message.get("agent")
            if agent is None or agent == self.envelope.agent:
                self.rejected = message["reason"]
                self._warn("reject", f"nand: the server rejected this agent: {self.rejected}")
            else:
                self._drop_earlier_agent(agent, message["reason"])

    def _drop_earlier_agent(self, agent: str, reason: str) -> None:
        """The server refused frames an earlier agent of this rank spooled (say,
        under another token): they are lost, counted, and this agent goes on."""
        lost = self.outbox.refused(agent)
        if lost:
            self.mailbox.drop("rejected", lost)
        self._warn(
            f"reject-{agent}",
            f"nand: the server refused the spooled messages of an earlier agent of "
            f"this rank ({agent}): {reason}; they are dropped, this agent goes on",
        )

    # --- where new frames go ------------------------------------------------

    def _route(self, batch: list[Outgoing]) -> None:
        for out in batch:
            try:
                frame = self._encode(out)
            except Exception as exc:  # e.g. a body msgpack cannot carry
                self._warn("encode", f"nand: cannot encode a {out.kind}: {exc!r}")
                self.mailbox.drop("encode_error")
                continue
            if frame is None:
                continue
            if self.rejected is not None:
                self.mailbox.drop("rejected")
            else:
                self._add(frame)
        self.stats["routed"] += len(batch)

    def _add(self, frame: Frame) -> None:
        """Hand one frame to the outbox; a failure loses that frame, counted,
        and never the rest of the batch."""
        try:
            self.outbox.add(frame)
        except Exception as exc:
            self._warn("add", f"nand: cannot keep a {frame.kind} for sending: {exc!r}")
            self.mailbox.drop("spool_error")

    def _encode(self, out: Outgoing) -> Frame | None:
        env = self.envelope
        data = wire.encode(outgoing_message(env, out))
        if len(data) > self.settings.max_frame_bytes:
            self._warn("too_large", f"nand: dropping a {out.kind} of {len(data)} bytes")
            self.mailbox.drop("too_large")
            return None
        return Frame(agent=env.agent, seq=out.seq, kind=out.kind, keep=out.keep, data=data)

    # --- sending --------------------------------------------------------------

    def _pump(self) -> None:
        if self.connected and self.rejected is None:
            self.outbox.pump(self._send)

    def _send(self, frame: Frame) -> bool:
        """Put one frame on the socket; False when it would block."""
        try:
            self.sock.send(frame.data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    # --- shutdown ---------------------------------------------------------------

    def _teardown(self) -> None:
        """Flush with the time left before the deadline; spool what is left."""
        deadline = self._stop_at or time.monotonic()
        reserve = min(0.5, 0.25 * max(0.0, deadline - time.monotonic()))
        while self.outbox.has_unacked() and time.monotonic() < deadline - reserve:
            with contextlib.suppress(Exception):
                self._poll(min(0.02, max(0.0, deadline - reserve - time.monotonic())))
                self._read_monitor()
                self._read_incoming()
                self._route(self.mailbox.take_all())
                self._pump()
            if self.rejected is not None or not (self.connected or self._connecting()):
                break
        # Each last step on its own: what is left is said even if one fails.
        self._guarded(lambda: self._route(self.mailbox.take_all()))
        self._guarded(self._spool_the_rest)
        self._guarded(self.outbox.lose_memory)
        self._guarded(self._say_what_is_left)
        self._release()

    def _connecting(self) -> bool:
        """Still within the connect grace: a job that exits right after its
        first message (or on a loaded host, where the handshake takes a while)
        waits for the connection instead of spooling what a live server would
        take; a server that is down costs at most the grace."""
        return time.monotonic() < self._grace_until

    def _spool_the_rest(self) -> None:
        if self.outbox.mode == "direct" and self.outbox.has_unacked():
            self.outbox.to_spool()

    def _say_what_is_left(self) -> None:
        self.silence.at_exit(len(self.backlog), self.mailbox.dropped_counts())

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as exc:
            self._warn(type(exc).__name__, f"nand: sender error at exit: {exc!r}")

    def _release(self) -> None:
        self.backlog.close()
        self._close_socket()
        with contextlib.suppress(Exception):
            if self.ctx is not None:
                self.ctx.term()
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:  # log each kind of trouble once, not per message
            self._warned.add(key)
            log.warning(message)
