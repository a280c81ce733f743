"""The sender thread: owns the ZeroMQ DEALER socket, the in-flight window and the spool.

Two modes, one order. Every message of this agent is either in flight, in the
memory queue or in the spool, and they are sent oldest first:

- **direct**: new frames queue in memory and go out through the socket, at
  most ``window`` unacknowledged at a time.
- **spool**: entered when the connection drops, a send would block, the
  oldest frame waits longer than its ack deadline, or memory is over
  ``queue_max``. Everything not yet acknowledged is appended to the spool, and
  so is every new frame while the spool holds anything. When the socket is
  connected, the spool is replayed from its first record (the server drops
  what it already has); once all of it is acknowledged the file is emptied and
  the mode is direct again. Going back to the first record after a reconnect
  is what keeps each agent's messages in order at the server.

The ack deadline of a frame is ``ack_timeout_s * 2**failures`` (at most 60 s)
with ±20 % jitter, ``failures`` counting the consecutive timeouts; an ack
resets it. Connection state comes from the socket's monitor (handshake
succeeded / disconnected); ``ZMQ_IMMEDIATE`` keeps frames from being queued to
a connection that is not up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from nand import wire
from nand.agent.transport import connection
from nand.agent.transport import spool as spool_mod
from nand.agent.transport.backlog import Backlog
from nand.agent.transport.frames import Envelope, Frame, spooled_frame
from nand.agent.transport.mailbox import Mailbox, Outgoing
from nand.config import TransportConfig
from nand.errors import WireError

log = logging.getLogger("nand.agent.transport")
_MAX_BACKOFF_S = 60.0
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
        super().__init__(name=f"nand-sender-{envelope.rank}", daemon=True)
        #: Called on every turn of the loop, on this thread (the sink's keepalive).
        self.on_idle = on_idle
        self.endpoint = endpoint
        self.envelope = envelope
        self.mailbox = mailbox
        self.settings = settings
        self.spool_path = spool_path
        self.stats = {"routed": 0, "sent": 0, "acked": 0, "spooled": 0, "replayed": 0, "resends": 0}
        self.connected = False
        self.mode = "direct"
        self.rejected: str | None = None
        self._stop_at: float | None = None
        self._queue: deque[Frame] = deque()
        self._inflight: OrderedDict[tuple[str, int], Frame] = OrderedDict()
        self._warned: set[str] = set()
        self.backlog = Backlog(
            spool_path, envelope.agent, settings.spool_max_bytes, mailbox, self._warn
        )
        self._cursor: int | None = None
        self._failures = 0
        self._retry_at = 0.0
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
        return len(self._queue) + sum(1 for f in self._inflight.values() if not f.from_spool)

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
        self.sock = connection.dealer(
            self.ctx,
            self.endpoint,
            curve_server_key=self.settings.curve_server_key,
            immediate=True,
            sndhwm=self.settings.window * 2,
        )
        self.monitor = self.sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS | _FAIL_EVENTS)
        self.sock.connect(self.endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        if self.backlog.adopt_orphans(self.envelope.rank):
            self.mode = "spool"

    def _step(self) -> bool:
        """One turn of the loop; True when the thread should end."""
        self._poll(self._poll_timeout())
        self._read_monitor()
        self._read_incoming()
        self._route(self.mailbox.take_all())
        self._check_deadlines()
        self._pump()
        if self.on_idle is not None and self._stop_at is None:
            self.on_idle()
        return self._stop_at is not None

    def _poll_timeout(self) -> float:
        timeout = self.settings.poll_interval_s
        if self._inflight:
            first = next(iter(self._inflight.values()))
            timeout = min(timeout, max(0.0, first.deadline - time.monotonic()))
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
                if self.mode == "spool":
                    self._cursor = None  # replay from the first record
            elif event & _DOWN_EVENTS and self.connected:
                self.connected = False
                self._to_spool()
            elif event & _FAIL_EVENTS:
                self._warn("handshake", f"nand: handshake with {self.endpoint} failed")

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
            agent = message.get("agent") or self._inflight_agent() or self.envelope.agent
            for seq in message["seqs"]:
                if self._inflight.pop((agent, seq), None) is not None:
                    self.stats["acked"] += 1
                    self._failures = 0
        elif kind == "command":
            self.mailbox.add_command({k: v for k, v in message.items() if k != "v"})
        elif kind == "reject":
            self.rejected = message["reason"]
            self._warn("reject", f"nand: the server rejected this agent: {self.rejected}")

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
            elif self.mode == "spool":
                self._append_to_spool(frame)
            elif self.memory_frames >= self.settings.queue_max:
                # Checked before each frame, not after: a whole batch (up to
                # the mailbox's size) must not sit in memory beyond the bound,
                # not even for the moment before it is spooled.
                self._to_spool()
                self._append_to_spool(frame)
            else:
                self._queue.append(frame)
        self.stats["routed"] += len(batch)

    def _encode(self, out: Outgoing) -> Frame | None:
        env = self.envelope
        message = wire.agent_message(
            out.kind, agent=env.agent, seq=out.seq, run=env.run, rank=env.rank, body={}
        )
        message["time"] = out.time
        message["body"] = out.build_body()
        data = wire.encode(message)
        if len(data) > self.settings.max_frame_bytes:
            self._warn("too_large", f"nand: dropping a {out.kind} of {len(data)} bytes")
            self.mailbox.drop("too_large")
            return None
        return Frame(env.agent, out.seq, out.kind, out.keep, data)

    def _to_spool(self) -> None:
        """Move everything unacknowledged that is only in memory to the spool."""
        pending = [f for f in self._inflight.values() if not f.from_spool]
        pending.extend(self._queue)
        self.mode = "spool"
        self._cursor = None
        # Write first, forget after: flush() (another thread) must never see a
        # moment where a frame is neither in memory nor on disk.
        for frame in pending:
            self._append_to_spool(frame)
        self._queue.clear()
        self._inflight.clear()

    def _append_to_spool(self, frame: Frame) -> None:
        if self.backlog.append(frame.data, frame.kind, frame.keep):
            self._cursor = None  # a compaction moved the records: replay from the start
            self._inflight.clear()
        self.stats["spooled"] += 1

    # --- sending --------------------------------------------------------------

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.mode == "direct" and not self.connected and now > self._grace_until:
            self._to_spool()  # never connected yet: keep messages on disk, not in memory
        if self._inflight and next(iter(self._inflight.values())).deadline < now:
            self._failures += 1
            self.stats["resends"] += 1
            self._to_spool()

    def _deadline(self) -> float:
        base = min(_MAX_BACKOFF_S, self.settings.ack_timeout_s * 2.0 ** min(self._failures, 10))
        return time.monotonic() + base * random.uniform(0.8, 1.2)

    def _pump(self) -> None:
        if not self.connected or self.rejected is not None:
            return
        if self.mode == "direct":
            while self._queue and len(self._inflight) < self.settings.window:
                if not self._send(self._queue[0]):
                    return
                self._queue.popleft()
        elif time.monotonic() >= self._retry_at:
            self._replay()

    def _inflight_agent(self) -> str | None:
        """The agent whose frames are in flight: there is only ever one.

        A spool may hold frames of earlier agents of this rank. Sending one
        agent's frames at a time lets an ack that does not name its agent
        (allowed by the wire format) still be matched without doubt.
        """
        return next(iter(self._inflight))[0] if self._inflight else None

    def _send(self, frame: Frame) -> bool:
        try:
            self.sock.send(frame.data, zmq.NOBLOCK)
        except zmq.Again:  # not connected after all, or the peer is not reading
            self._to_spool()
            self._retry_at = time.monotonic() + min(_MAX_BACKOFF_S, 0.5 * 2**self._failures)
            return False
        frame.deadline = self._deadline()
        self._inflight[(frame.agent, frame.seq)] = frame
        self.stats["sent"] += 1
        return True

    def _replay(self) -> None:
        spool = self.backlog.spool
        if spool is None:
            self.mode = "direct"
            return
        if self._cursor is None:
            self._cursor = spool_mod.HEADER_SIZE
            self._inflight.clear()
        room = self.settings.window - len(self._inflight)
        if room > 0 and self._cursor < spool.size:
            for end, tag, payload in spool.read_from(self._cursor, max_records=room):
                frame = spooled_frame(payload, tag)
                if self._inflight and frame.agent != self._inflight_agent():
                    break  # one agent in flight at a time: see _inflight_agent
                if not self._send(frame):
                    return
                self._cursor = end
                self.stats["replayed"] += 1
        if self._cursor >= spool.size and not self._inflight:
            spool.clear()
            self.mode = "direct"
            self._cursor = None

    # --- shutdown ---------------------------------------------------------------

    def _teardown(self) -> None:
        """Flush with the time left before the deadline; spool what is left."""
        deadline = self._stop_at or time.monotonic()
        reserve = min(0.5, 0.25 * max(0.0, deadline - time.monotonic()))
        while self.has_unacked() and time.monotonic() < deadline - reserve:
            with contextlib.suppress(Exception):
                self._poll(min(0.02, max(0.0, deadline - reserve - time.monotonic())))
                self._read_monitor()
                self._read_incoming()
                self._route(self.mailbox.take_all())
                self._pump()
            if not self.connected or self.rejected is not None:
                break
        with contextlib.suppress(Exception):
            self._route(self.mailbox.take_all())
            if self.mode == "direct" and self.has_unacked():
                self._to_spool()
        self._release()

    def has_unacked(self) -> bool:
        spooled = self.mode == "spool" and len(self.backlog) > 0
        return bool(self._queue or self._inflight or spooled)

    def _release(self) -> None:
        self.backlog.close()
        with contextlib.suppress(Exception):
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)
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
