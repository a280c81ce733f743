"""Agent id leases: which server speaks for an agent id, kept in the database.

Several servers may share one PostgreSQL, and an agent may reach any of them.
Within one server, :mod:`nand.server.agents.admission` keeps an agent id to the
connection it speaks on; across servers, that binding is a row of
``agent_leases``: ``(agent, server, expires)``. A server accepts messages for
an agent id only while it holds the lease:

- the first message a server accepts for an agent id *claims* it: one upsert
  that takes the row when it is free, already this server's, or expired; when
  another server holds it and its lease runs, the messages are refused
  (``agent_in_use``, not answered: the agent resends and gets in once the
  lease is free);
- every ``lease_s / 3`` a server *renews* the leases of the agents it heard,
  each to ``lease_s`` after it last heard the agent: an agent that moved away
  (or whose server was killed) is free about ``lease_s`` after its server last
  heard it;
- a server that stops cleanly *releases* its leases, so its agents move at once.

A server is named by its host and bound ZeroMQ endpoint: a server restarted on
the same address (one ``nand server`` after a crash) still holds its agents.
Expiry times are the servers' wall clocks, so servers sharing a database need
clocks within a fraction of ``lease_s`` of each other (NTP does that).

>>> from nand.server.storage.db import make_engine
>>> from nand.server.storage.migrate import upgrade
>>> engine = make_engine("sqlite:///:memory:"); upgrade(engine)
>>> a, b = Leases(engine, 15.0, "host-a tcp://a:5557"), Leases(engine, 15.0, "host-b tcp://b:5557")
>>> a.claim({"agent-1"}, now=100.0), b.claim({"agent-1"}, now=101.0)
(set(), {'agent-1'})
>>> a.heard({"agent-1"}, now=110.0); a.renew_if_due(now=111.0)  # held until 110 + 15
>>> b.claim({"agent-1"}, now=122.0), b.claim({"agent-1"}, now=126.0)
({'agent-1'}, set())
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

from sqlalchemy import Engine, delete, or_, select, update

from nand.server.storage.db import chunks, dialect_insert
from nand.server.storage.models import AgentLease

log = logging.getLogger("nand.server.agents.leases")

#: How long one call of ``renew_if_due`` writes before it lets the ingest go on.
RENEW_SLICE_S = 0.03


class Leases:
    """This server's leases: ``claim`` before accepting, ``heard`` on every
    accepted message, ``renew_if_due`` from the ingest loop, ``release_all``
    at shutdown."""

    def __init__(self, engine: Engine, lease_s: float, server: str = "") -> None:
        self.engine = engine
        self.lease_s = lease_s
        self.server = server
        #: Agent id → when its lease, as last written here, ends.
        self.held: dict[str, float] = {}
        #: Agent id → when a message of it was last accepted here.
        self.seen: dict[str, float] = {}
        self._renewed = 0.0
        #: Renewals planned and not yet written: ``(expires, agents)``.
        self._due: list[tuple[float, Sequence[str]]] = []

    def missing(self, agents: Iterable[str], now: float) -> set[str]:
        """The agent ids this server does not hold a lease of that runs a while yet
        (a margin: the clocks of servers differ a little)."""
        until = now + self.lease_s / 6
        return {agent for agent in agents if self.held.get(agent, 0.0) <= until}

    def claim(self, agents: set[str], now: float) -> set[str]:
        """Claim ``agents``' leases; the ones another live server holds."""
        if not agents:
            return set()
        expires = self._expiry(now)
        with self.engine.begin() as conn:
            for chunk in chunks(sorted(agents)):  # one lock order for every server
                insert = dialect_insert(conn, AgentLease)
                statement = insert.on_conflict_do_update(
                    index_elements=[AgentLease.agent],
                    set_={"server": insert.excluded.server, "expires": insert.excluded.expires},
                    where=or_(AgentLease.server == self.server, AgentLease.expires < now),
                )
                rows = [{"agent": a, "server": self.server, "expires": expires} for a in chunk]
                conn.execute(statement, rows)
            elsewhere: set[str] = set()
            for chunk in chunks(sorted(agents)):
                found = select(AgentLease.agent).where(
                    AgentLease.agent.in_(chunk), AgentLease.server != self.server
                )
                elsewhere.update(conn.scalars(found))
        for agent in agents - elsewhere:
            self.held[agent] = expires
        return elsewhere

    def heard(self, agents: Iterable[str], now: float) -> None:
        for agent in agents:
            self.seen[agent] = now

    def renew_if_due(self, now: float | None = None, budget_s: float = RENEW_SLICE_S) -> None:
        """Every third of a lease: plan to extend each lease to ``lease_s`` after its
        agent was last heard (to a sixth of a lease), and forget agents not heard
        for ``lease_s`` (another server may take them once their lease runs out).
        Each call writes the plan for about ``budget_s`` (at least one chunk), so
        the ingest loop that calls it between batches never stalls on the
        renewal of every agent at once (0.4-0.6 s at 20,000 agents)."""
        now = time.time() if now is None else now
        if not self._due and now - self._renewed >= self.lease_s / 3:
            self._renewed = now
            self._due = self._plan(now)
        deadline = time.perf_counter() + budget_s
        try:
            while self._due:
                expires, planned = self._due.pop()
                # (a batch may have claimed one since, to a later expiry)
                agents = [a for a in planned if self.held.get(a, 0.0) < expires]
                if agents:
                    self._renew(agents, expires)
                if time.perf_counter() >= deadline:
                    break
        except Exception as exc:  # the database is away: the leases run out, claimed again
            self._due.clear()
            log.warning("could not renew agent leases: %s", exc)

    def _plan(self, now: float) -> list[tuple[float, Sequence[str]]]:
        """The renewals due: ``(expires, agents)`` chunks, leaving out the leases
        already written to that expiry (an agent not heard since the last renewal)."""
        horizon = now - self.lease_s
        for agent in [a for a, t in self.seen.items() if t < horizon]:
            del self.seen[agent]
            self.held.pop(agent, None)
        by_expiry: dict[float, list[str]] = defaultdict(list)
        for agent, heard in self.seen.items():
            expires = self._expiry(heard)
            if self.held.get(agent) != expires:
                by_expiry[expires].append(agent)
        return [
            (expires, chunk)
            for expires, agents in by_expiry.items()
            for chunk in chunks(sorted(agents))
        ]

    def _expiry(self, heard: float) -> float:
        """When the lease of an agent last heard at ``heard`` ends: ``lease_s`` later,
        rounded up to a sixth of a lease, so that the leases of many agents share a
        few expiries (a statement each), and a claim's is the one its renewal
        would write (a lease claimed on a message is not written again for it)."""
        step = self.lease_s / 6
        return math.ceil(heard / step) * step + self.lease_s

    def _renew(self, agents: list[str], expires: float) -> None:
        with self.engine.begin() as conn:
            statement = (
                update(AgentLease)
                .where(AgentLease.agent.in_(agents), AgentLease.server == self.server)
                .values(expires=expires)
                .returning(AgentLease.agent)
            )
            renewed = set(conn.scalars(statement))
        for agent in agents:  # one another server took meanwhile is claimed again
            if agent in renewed:
                self.held[agent] = expires
            else:
                self.held.pop(agent, None)

    def release_all(self) -> None:
        """Give up every lease of this server (a clean stop): its agents may move now."""
        self.held.clear()
        self.seen.clear()
        self._due.clear()
        try:
            with self.engine.begin() as conn:
                conn.execute(delete(AgentLease).where(AgentLease.server == self.server))
        except Exception as exc:
            log.warning("could not release agent leases: %s", exc)
