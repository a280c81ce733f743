"""Which messages the ingest loop lets in: each agent speaks only for itself.

An agent's identity is its id together with the run and rank it introduced
itself with. The first message the server accepts for an agent id *binds* it:
to that (run, rank) and to the ZeroMQ connection it came on. After that:

- a message whose run or rank differs from the binding is refused
  (``identity_mismatch``): no agent writes into another run or rank;
- a message for the agent id from another connection, while the bound
  connection is still up, is refused (``agent_in_use``): nobody can pre-send
  an agent's sequence numbers (which the server would then drop as
  duplicates of the real messages) or write under its name;
- once the bound connection is gone, the next connection that speaks for the
  agent id takes it over: that is an agent reconnecting (a new ZeroMQ
  connection, so a new routing id) or a spool replayed by the next agent of
  the rank.

A run id the REST API could not address (``a/b``, ``..``: see
:func:`nand.runids.run_problem`) is refused first (``bad_run``).

With a token (``NAND_TOKEN``), only a ``hello`` carrying it binds a new agent
id (anything else is ``unauthenticated``); an id that said such a hello is in
the ``agents`` table, so it binds again after a server restart or on another
server sharing the database, to the (run, rank) of that hello. Without a
token anyone may send, so the first message binds (the hello, for a real
agent): the binding still keeps agents apart, but a token is what keeps
strangers out.

Identity refusals are counted and logged once per agent but not answered: a
``reject`` would make a real agent stop sending for good, and the one case a
real agent meets (it reconnected before the server noticed its old
connection was gone) resolves itself when it resends.

Bindings are a bounded cache (least recently used go first); a binding that
was dropped is looked up in the database again, or made again by the next
message, as after a restart.

Across servers sharing the database, an agent id is held by one of them at a
time through a lease (:mod:`nand.server.agents.leases`): :meth:`Admission.leased`
claims it for what this server accepted and refuses (``agent_in_use``) what
another live server holds.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from nand import wire
from nand.runids import run_problem
from nand.server.agents.leases import Leases
from nand.server.storage.models import Agent, Run

log = logging.getLogger("nand.server.agents.admission")

#: Reasons this module refuses a message for (besides "unauthenticated"): the wire's.
IDENTITY_REASONS = wire.IDENTITY_REASONS

#: Is the connection with this routing id still up? (asked with the agent id).
StillConnected = Callable[[bytes, str], bool]
#: Messages with the routing id of the connection they came on.
Accepted = list[tuple[bytes, dict[str, Any]]]


@dataclass
class Binding:
    """Who an agent id is: its (run, rank), and the connection that speaks for it."""

    run: str
    rank: int
    ident: bytes | None  # None: known from the database, no connection here yet


class Bindings:
    """Agent id → :class:`Binding`, at most ``limit`` of them (least recently used go)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Binding] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, agent: str) -> bool:
        return agent in self._items

    def get(self, agent: str) -> Binding | None:
        binding = self._items.get(agent)
        if binding is not None:
            self._items.move_to_end(agent)
        return binding

    def put(self, agent: str, binding: Binding) -> None:
        self._items[agent] = binding
        self._items.move_to_end(agent)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


class Admission:
    """Decides, message by message, whether a connection may speak for an agent."""

    def __init__(
        self,
        engine: Engine,
        token: str | None,
        still_connected: StillConnected,
        limit: int,
        leases: Leases,
    ) -> None:
        self.engine = engine
        self.leases = leases
        self.token = token
        self.still_connected = still_connected
        self.bindings = Bindings(limit)
        #: Connections probed during this batch (a flood of forged messages
        #: costs one probe per connection and batch, not one per message).
        self._probed: dict[bytes, bool] = {}

    def prepare(self, agents: Iterable[str]) -> None:
        """Load the bindings of the batch's agents that said hello before (one query)."""
        self._probed.clear()
        missing = {agent for agent in agents if agent not in self.bindings}
        if not missing:
            return
        statement = (
            select(Agent.agent, Run.name, Agent.rank)
            .join(Run, Run.id == Agent.run_id)
            .where(Agent.agent.in_(missing))
        )
        with Session(self.engine) as session:
            for agent, run, rank in session.execute(statement):
                self.bindings.put(agent, Binding(run, rank, None))

    def refusal(self, ident: bytes, message: dict[str, Any]) -> str | None:
        """Why ``message`` from connection ``ident`` is refused, or None to accept it."""
        if run_problem(message["run"]) is not None:
            return "bad_run"
        agent = message["agent"]
        binding = self.bindings.get(agent)
        if self.token and message["kind"] == "hello" and not self._valid_token(message):
            return "unauthenticated"
        if binding is None:
            if self.token and message["kind"] != "hello":
                return "unauthenticated"
            self.bindings.put(agent, Binding(message["run"], message["rank"], ident))
            return None
        if (binding.run, binding.rank) != (message["run"], message["rank"]):
            return "identity_mismatch"
        if binding.ident != ident:
            if binding.ident is not None and self._connected(binding.ident, agent):
                return "agent_in_use"
            binding.ident = ident  # the agent reconnected, or its spool is replayed
        return None

    def leased(self, accepted: Accepted) -> tuple[Accepted, Accepted]:
        """Split what :meth:`refusal` let in: the messages of agent ids this server
        holds the lease of (claimed now if needed), and those another live
        server holds, which are refused. With the database away, the messages of
        agents not yet held are in neither: not acked, the agents resend them."""
        now = time.time()
        agents = {message["agent"] for _, message in accepted}
        missing = self.leases.missing(agents, now)
        elsewhere: set[str] = set()
        try:
            elsewhere = self.leases.claim(missing, now)
        except Exception as exc:
            log.warning("could not claim %d agent leases: %s", len(missing), exc)
            agents -= missing
            accepted = [(i, m) for i, m in accepted if m["agent"] in agents]
        self.leases.heard(agents - elsewhere, now)
        if not elsewhere:
            return accepted, []
        for agent in elsewhere:  # no connection here speaks for it. The binding stays:
            # with a token it came from a valid hello (or the database), and without
            # one the agent's next messages (no hello among them) must still pass.
            binding = self.bindings.get(agent)
            if binding is not None:
                binding.ident = None
        kept = [(i, m) for i, m in accepted if m["agent"] not in elsewhere]
        return kept, [(i, m) for i, m in accepted if m["agent"] in elsewhere]

    def _connected(self, ident: bytes, agent: str) -> bool:
        if ident not in self._probed:
            self._probed[ident] = self.still_connected(ident, agent)
        return self._probed[ident]

    def _valid_token(self, message: dict[str, Any]) -> bool:
        given = message["body"].get("token")
        expected = (self.token or "").encode()
        return isinstance(given, str) and hmac.compare_digest(given.encode(), expected)
