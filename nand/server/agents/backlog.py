"""The messages the ingest has read and not yet written: what decides a verdict first.

A big job's ranks send heartbeats all the time (2,000 a second at 100,000
ranks, :mod:`nand.cadence`), and an event that arrives behind thousands of them
used to wait until every one was stored: seconds between a NaN and the
verdict that names it. So the ingest loop reads what the socket holds into
this queue (bounded: :meth:`Backlog.room`), and each batch it writes is
:meth:`Backlog.take`'s:

- when the queue holds a message of a kind that *goes first*
  (:data:`FIRST_KINDS`), the batch is those messages and, for each, the
  messages of its agent queued before it: nothing else;
- otherwise the oldest messages, in the order they came.

Which kinds go first: what the verdict reads. ``event`` (the NaN: origin,
spread), ``bye`` (a rank finished or crashed: the run's state), ``flight`` and
``warning`` (the verdict's hint and warnings; rare). The periodic reports
wait: ``heartbeat`` (progress; a rank is called lost only after minutes of
silence) and ``fingerprint`` (the replicas' check needs every rank's, a
period apart), and so does ``hello`` (a rank joining decides no verdict, and
a hello flood at a job's start need not hold up its heartbeats).

Heartbeats wait while messages that go first keep coming, at most until the
queue is full: then the ingest reads nothing more (ZeroMQ holds the rest, as
it did before) and the next batches are the heartbeats.

Order within an agent is kept: its messages are written in the order they
came, because an event of an agent whose ``hello`` is still queued takes the
hello with it (the hello decides the attempt the event belongs to,
:mod:`nand.server.agents.attempts`), and a bye its heartbeats. Across agents
there was never an order to keep: ZeroMQ interleaves connections as it likes.
Acknowledgements still follow the commit of the batch a message was written
in, and the writer still drops a message stored before (``(agent, seq)``).

>>> queue = Backlog(max_messages=10, max_bytes=1_000)
>>> def m(kind, agent, seq):
...     return (b"conn", {"kind": kind, "agent": agent, "seq": seq})
>>> queue.add([m("heartbeat", "a", 1), m("heartbeat", "b", 1), m("hello", "c", 1),
...            m("heartbeat", "b", 2), m("event", "c", 2)], size=500)
>>> [(msg["agent"], msg["seq"]) for _, msg in queue.take(100)]  # c's event, with its hello
[('c', 1), ('c', 2)]
>>> [(msg["agent"], msg["seq"]) for _, msg in queue.take(2)]  # then the oldest
[('a', 1), ('b', 1)]
>>> queue.room()
(9, 900)
"""

from __future__ import annotations

from collections import deque
from typing import Any

from nand.wire.kinds import VERDICT_FIRST

#: Kinds written before the others queued with them (see the module doc): the
#: wire's table says which (``Kind.decides_verdict``).
FIRST_KINDS = VERDICT_FIRST

#: A message with the routing id of the connection it came on.
Entry = tuple[bytes, dict[str, Any]]
#: An entry queued, with the bytes of frames it is charged.
Queued = tuple[bytes, dict[str, Any], int]


class Backlog:
    """A bounded queue of admitted messages: ``add`` what was read, ``take`` a batch."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        #: (connection, message, bytes charged), in the order they came.
        self._queue: deque[Queued] = deque()
        self._bytes = 0
        #: How many queued messages go first (none: take from the front).
        self._first = 0

    def __len__(self) -> int:
        return len(self._queue)

    def room(self) -> tuple[int, int]:
        """How many more messages, and bytes of frames, the ingest may read now."""
        return self.max_messages - len(self._queue), self.max_bytes - self._bytes

    def add(self, entries: list[Entry], size: int) -> None:
        """Queue ``entries`` (admitted, in the order they came), read as ``size``
        bytes of frames: each is charged its share, rejected frames' included."""
        share = size // max(1, len(entries))
        for ident, message in entries:
            self._queue.append((ident, message, share))
            self._first += message["kind"] in FIRST_KINDS
        self._bytes += share * len(entries)

    def take(self, limit: int) -> list[Entry]:
        """The next batch, at most ``limit`` messages (see the module doc)."""
        if not self._first:
            count = min(limit, len(self._queue))
            return self._remove([self._queue.popleft() for _ in range(count)])
        last_first: dict[str, int] = {}  # agent → position of its last message that goes first
        for position, (_, message, _) in enumerate(self._queue):
            if message["kind"] in FIRST_KINDS:
                last_first[message["agent"]] = position
        taken: list[Queued] = []
        kept: deque[Queued] = deque()
        for position, entry in enumerate(self._queue):
            # An agent's taken messages are always the front of its own: the
            # batch is cut in the order they came, never within an agent.
            if len(taken) < limit and last_first.get(entry[1]["agent"], -1) >= position:
                taken.append(entry)
            else:
                kept.append(entry)
        self._queue = kept
        return self._remove(taken)

    def clear(self) -> None:
        """Forget every queued message (not acknowledged: their agents send them again)."""
        self._remove(list(self._queue))
        self._queue.clear()

    def _remove(self, entries: list[Queued]) -> list[Entry]:
        for _, message, share in entries:
            self._bytes -= share
            self._first -= message["kind"] in FIRST_KINDS
        return [(ident, message) for ident, message, _ in entries]


#: About how long writing one batch may take: what an event that arrives
#: meanwhile waits before its own batch is written.
BATCH_TARGET_S = 0.25
#: The fewest messages a full batch is cut to, however slow the database.
MIN_BATCH = 100


class Pace:
    """How many messages the next batch takes: as many as the last batches of at
    least :data:`MIN_BATCH` wrote in :data:`BATCH_TARGET_S` (at most ``most``).

    A batch of 2,000 heartbeats of 2,000 ranks took a second and more on a
    loaded host at 100,000 ranks; one of 8 agents' heartbeats, a tenth of
    that; 1,000 hellos of a 20,000-rank job's start, a second (they were
    never a full batch: the senders' windows held 1,000, and an event that
    came meanwhile waited it out). The size follows the time a message took
    (a moving average), so a batch stays near the target on any of them.

    >>> pace = Pace(most=2000)
    >>> pace.size()
    2000
    >>> pace.wrote(2000, 2.0); pace.size()  # 1 ms a message
    250
    >>> pace.wrote(250, 0.0125); pace.size()  # then 0.05 ms: it grows back
    349
    >>> pace.wrote(10, 5.0); pace.size()  # too few to say: mostly a batch's own cost
    349
    """

    def __init__(self, most: int) -> None:
        self.most = most
        self._per_message = 0.0

    def size(self) -> int:
        if self._per_message <= 0:
            return self.most
        return max(MIN_BATCH, min(self.most, int(BATCH_TARGET_S / self._per_message)))

    def wrote(self, count: int, seconds: float) -> None:
        """A batch of ``count`` messages took ``seconds`` to write."""
        if count < MIN_BATCH:
            return
        rate = seconds / count
        self._per_message = rate if not self._per_message else 0.7 * self._per_message + 0.3 * rate
