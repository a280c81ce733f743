"""Which of the servers in ``NAND_SERVER`` this agent talks to, and when it moves on.

Used by the sender thread only. The agent holds one connection at a time; it
starts at ``endpoints[rank % len(endpoints)]`` and tries the others in an
order of its own (:func:`nand.endpoints.order_for_rank`: the ranks of a dead
server spread over the rest). The connection is judged dead, and the agent
moves to the next endpoint of its order (wrapping around), when:

- it has not been up for ``after_s`` seconds: the server was killed (the
  ZeroMQ monitor says *disconnected* at once), the network is cut (ZeroMQ's
  own heartbeat says so within its timeout), or nothing answers at that
  address at all; or
- it is up but ``ack_failures`` acknowledgement deadlines in a row passed: a
  server that accepts connections and stores nothing.

On a move the sender resends, to the new server, every message not yet
acknowledged (from the spool, as after any reconnect). The servers share one
database, which drops a message it already stored by its ``(agent, seq)`` key,
so a message acknowledged by nobody but stored by the dead server is not
stored twice. With one endpoint nothing here ever moves: the agent waits for
its server (or a load balancer in front of several) as before.
"""

from __future__ import annotations

import time

from nand.endpoints import order_for_rank

#: Seconds without a connection before trying the next server.
AFTER_S = 2.0
#: Acknowledgement deadlines missed in a row, while connected, before moving on.
ACK_FAILURES = 2


class Failover:
    def __init__(self, endpoints: list[str], rank: int, after_s: float = AFTER_S) -> None:
        self.endpoints = endpoints
        self.order = order_for_rank(rank, len(endpoints))
        self.turn = 0  # position in ``order``
        self.after_s = after_s
        self.moves = 0
        self._down_since: float | None = time.monotonic()

    @property
    def current(self) -> str:
        return self.endpoints[self.order[self.turn]]

    def due(self, connected: bool, ack_failures: int) -> bool:
        """Whether to leave the current server now (called on every turn)."""
        now = time.monotonic()
        if connected:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = now
        if len(self.endpoints) < 2:
            return False
        if self._down_since is not None:
            return now - self._down_since >= self.after_s
        return ack_failures >= ACK_FAILURES

    def advance(self) -> str:
        """Move to the next endpoint of this rank's order; return it."""
        self.turn = (self.turn + 1) % len(self.order)
        self.moves += 1
        self._down_since = time.monotonic()
        return self.current
