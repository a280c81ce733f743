"""Where every unacknowledged frame of one agent is: in flight, in memory or on disk.

Used by the sender thread only. Two modes, one order; frames go out oldest first:

- **direct**: new frames queue in memory and go out through the socket, at
  most ``window`` unacknowledged at a time.
- **spool**: entered when the connection drops, a send would block, the
  oldest frame waits longer than its ack deadline, or memory is over
  ``queue_max``. Everything not yet acknowledged is appended to the spool, and
  so is every new frame while the spool holds anything. When the socket is
  connected, the spool is replayed from the first record not yet acknowledged;
  once its last record is sent the mode is direct again (new frames go out
  behind it), and the file is emptied when all of it is acknowledged.

When the disk refuses a frame (full, failing), the frame stays in memory,
behind anything on disk and ahead of newer frames; memory holds at most
``queue_max`` frames, and what that bound drops (heartbeats first; never hello,
the first incident or bye) is counted as ``disk_full`` (or ``spool_error``).

The ack deadline of a frame is ``ack_timeout_s * 2**failures`` (at most 60 s)
with ±20 % jitter, ``failures`` counting the consecutive timeouts; an ack
resets it.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Literal

from nand.agent.transport.backlog import Backlog
from nand.agent.transport.frames import Frame, spooled_frame
from nand.agent.transport.mailbox import Mailbox
from nand.config import TransportConfig

MAX_BACKOFF_S = 60.0
Send = Callable[[Frame], bool]  # puts a frame on the socket; False if it would block


class Outbox:
    def __init__(
        self,
        agent: str,
        settings: TransportConfig,
        backlog: Backlog,
        mailbox: Mailbox,
        stats: dict[str, int],
    ) -> None:
        self.agent = agent
        self.settings = settings
        self.backlog = backlog
        self.mailbox = mailbox
        self.stats = stats
        self.mode: Literal["direct", "spool"] = "direct"
        self.queue: deque[Frame] = deque()
        self.inflight: OrderedDict[tuple[str, int], Frame] = OrderedDict()
        #: The next spool offset to send; None: from the acknowledged prefix on.
        self.cursor: int | None = None
        self.failures = 0
        self.retry_at = 0.0

    # --- what is where (also read from other threads) ---------------------------

    @property
    def memory_frames(self) -> int:
        """Frames held only in memory. Read from any thread: ``list`` copies
        the in-flight frames in one C call, which the sender cannot interleave."""
        inflight = list(self.inflight.values())
        return len(self.queue) + sum(not f.from_spool for f in inflight)

    def has_unacked(self) -> bool:
        on_disk = len(self.backlog) > 0 and (self.mode == "spool" or self.cursor is not None)
        return bool(self.queue or self.inflight or on_disk)

    def inflight_agent(self) -> str | None:
        """The agent whose frames are in flight: there is only ever one.

        A spool may hold frames of earlier agents of this rank. Sending one
        agent's frames at a time lets an ack that does not name its agent
        (allowed by the wire format) still be matched without doubt.
        """
        return next(iter(self.inflight))[0] if self.inflight else None

    def oldest_deadline(self) -> float | None:
        return next(iter(self.inflight.values())).deadline if self.inflight else None

    # --- new frames and the spool -------------------------------------------------

    def add(self, frame: Frame) -> None:
        """A new frame: queued for sending, or spooled behind what is spooled."""
        if self.mode == "spool":
            self._append_to_spool(frame)
        elif self._maybe_full() and self.memory_frames >= self.settings.queue_max:
            # Checked before each frame, not after: a whole batch (up to the
            # mailbox's size) must not sit in memory beyond the bound, not
            # even for the moment before it is spooled.
            self.to_spool(resend=False)
            self._append_to_spool(frame)
        else:
            self.queue.append(frame)

    def _maybe_full(self) -> bool:
        """Whether memory may hold ``queue_max`` frames: an O(1) bound first, so
        that the exact count (a pass over the window) is taken only near it."""
        return len(self.queue) + len(self.inflight) >= self.settings.queue_max

    def to_spool(self, resend: bool = True) -> None:
        """Move everything unacknowledged that is only in memory to the spool.

        ``resend``: the connection is in doubt (dropped, a send blocked, an
        ack overdue): replay from the first record not acknowledged. Without
        it (memory is full) the spool's records in flight stay in flight,
        their deadlines running, and the replay goes on where it was.
        """
        pending = [f for f in self.inflight.values() if not f.from_spool]
        pending.extend(self.queue)
        self.mode = "spool"
        if resend:
            self.cursor = None
        # Write first, forget after: flush() (another thread) must never see a
        # moment where a frame is neither in memory nor on disk.
        held: deque[Frame] = deque()
        for frame in pending:
            if held or not self._store(frame):
                held.append(frame)  # the disk refused: this one and all after stay here
        self.queue = held
        if resend:
            self.inflight.clear()
        else:
            for frame in pending:
                self.inflight.pop((frame.agent, frame.seq), None)
        self._bound_memory()

    def _append_to_spool(self, frame: Frame) -> None:
        """Spool a frame; in memory instead while older frames are (order) or
        when the disk refuses it."""
        if self.queue or not self._store(frame):
            self.queue.append(frame)
            self._bound_memory()

    def _store(self, frame: Frame) -> bool:
        """Write ``frame`` to the spool; False when the disk refused it."""
        stored = self.backlog.append(frame.data, frame.kind, frame.keep)
        if stored == "refused":
            return False
        if stored == "moved":
            self.cursor = None  # a compaction moved the records: replay from the start
            self.inflight.clear()
        self.stats["spooled"] += 1
        return True

    def _bound_memory(self) -> None:
        """At most ``queue_max`` frames in memory: drop the oldest heartbeat,
        else the oldest unmarked frame. Hello, the first incident and bye stay,
        and so do frames sent before (at most a window of them): the server
        may have stored them, and a loss must never be counted for a message
        that was not lost."""
        while self.memory_frames > self.settings.queue_max:
            held = self.queue  # (the scans stop early: kept and sent frames are few, in front)
            victim = next((f for f in held if f.kind == "heartbeat" and _droppable(f)), None)
            victim = victim or next((f for f in held if _droppable(f)), None)
            if victim is None:
                return
            self.queue.remove(victim)
            self.mailbox.drop(self.backlog.refusal or "queue_full")

    # --- sending and acknowledgements --------------------------------------------

    def pump(self, send: Send) -> None:
        """Send what the window allows: the spool's next records, then memory."""
        if self.mode == "spool" and time.monotonic() >= self.retry_at:
            self._replay(send)
        if self.mode == "direct":
            while self.queue and len(self.inflight) < self.settings.window:
                if not self._send(self.queue[0], send):
                    return
                self.queue.popleft()

    def _send(self, frame: Frame, send: Send) -> bool:
        if not send(frame):  # not connected after all, or the peer is not reading
            self.to_spool()
            self.retry_at = time.monotonic() + min(MAX_BACKOFF_S, 0.5 * 2**self.failures)
            return False
        frame.deadline = self._deadline()
        self.inflight[(frame.agent, frame.seq)] = frame
        self.stats["sent"] += 1
        return True

    def _deadline(self) -> float:
        base = min(MAX_BACKOFF_S, self.settings.ack_timeout_s * 2.0 ** min(self.failures, 10))
        return time.monotonic() + base * random.uniform(0.8, 1.2)

    def _replay(self, send: Send) -> None:
        """Send the spool's next records; direct mode once the last one is out."""
        spool = self.backlog.spool
        if spool is None:
            self.mode = "direct"
            return
        if self.cursor is None:  # (re)connected: from the first record not acknowledged
            self.cursor = self.backlog.acked_upto
            self.inflight.clear()
        room = self.settings.window - len(self.inflight)
        if room > 0 and self.cursor < spool.size:
            for end, tag, payload in spool.read_from(self.cursor, max_records=room):
                frame = spooled_frame(payload, tag, start=self.cursor)
                if self.inflight and frame.agent != self.inflight_agent():
                    break  # one agent in flight at a time: see inflight_agent
                if not self._send(frame, send):
                    return
                self.cursor = end
                self.stats["replayed"] += 1
        if self.cursor >= spool.size and self.inflight_agent() in (None, self.agent):
            self.mode = "direct"  # new frames follow the spool's last ones directly

    def acked(self, agent: str, seqs: list[int]) -> None:
        for seq in seqs:
            if self.inflight.pop((agent, seq), None) is not None:
                self.stats["acked"] += 1
                self.failures = 0

    def refused(self, agent: str) -> int:
        """Forget the frames of ``agent`` in flight: the server refused them and
        will never ack them. Returns how many (the spool moves past them)."""
        refused = [key for key in self.inflight if key[0] == agent]
        for key in refused:
            del self.inflight[key]
        return len(refused)

    def settle(self) -> None:
        """Track the acknowledged prefix of the spool; empty the file once all
        of it is acknowledged and the sender is past it (direct mode)."""
        if self.cursor is None or not len(self.backlog):
            return
        first = next((f for f in self.inflight.values() if f.from_spool), None)
        acked = first.start if first is not None else self.cursor
        self.backlog.acked_upto = max(self.backlog.acked_upto, acked)
        if self.mode == "direct" and first is None:
            self.backlog.clear()
            self.cursor = None

    def check_deadlines(self, connected: bool, grace_until: float) -> None:
        now = time.monotonic()
        if self.mode == "direct" and not connected and now > grace_until:
            self.to_spool()  # never connected yet: keep messages on disk, not in memory
        deadline = self.oldest_deadline()
        if deadline is not None and deadline < now:
            self.failures += 1
            self.stats["resends"] += 1
            self.to_spool()

    def reconnected(self) -> None:
        if self.mode == "spool":
            self.cursor = None  # replay from the first record not acknowledged

    def lose_memory(self) -> None:
        """At exit: frames that are neither acknowledged nor on disk, counted as lost."""
        lost = self.memory_frames
        if lost:
            self.mailbox.drop(self.backlog.refusal or "closed", lost)


def _droppable(frame: Frame) -> bool:
    return not (frame.keep or frame.sent)
