"""Commands from the server to agents: ``stop`` at a step, ``send_flight``.

Runs on the ingest thread (it sends through the ingest socket, via the
``send`` callable it is given). Its memory of connections is only a cache:
the stop itself lives in the database, so every server sharing it tells the
agents connected to it.

- ``stop``: every message from an agent of a run with a recorded stop step,
  whose rank has not said ``bye``, is answered with
  ``{"kind": "command", "command": "stop", "step": S, "reason": ...}`` (at
  most once per :data:`COMMAND_EVERY_S` per connection); and every
  ``poll_s`` the stops recorded since the last look are pushed to the agents
  known to be connected here, so they hear within about half a second.
- ``send_flight``: an event that arrives without a flight-recorder window,
  from a rank with no window stored, makes the server ask that agent once for
  its window (the hint needs it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, bindparam, select, tuple_
from sqlalchemy.orm import Session

from nand.server.metrics import Metrics
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Flight, Rank, Run

log = logging.getLogger("nand.server.agents.orders")

#: Seconds between two stop commands to one connection.
COMMAND_EVERY_S = 1.0
#: (run, rank) pairs remembered as asked for their flight window.
MAX_FLIGHT_ASKED = 100_000

Send = Callable[[bytes, dict[str, Any]], None]
Accepted = list[tuple[bytes, dict[str, Any]]]


@dataclass
class Peer:
    """A connection seen recently (a cache: the database is the truth)."""

    run: str
    rank: int
    seen: float
    commanded: float = 0.0


#: Every batch asks it: built once (the runs are an expanding parameter).
_PENDING_STOPS = (
    select(Run.name, Rank.rank, Run.stop_step, Run.stop_reason)
    .join(Rank, Rank.run_id == Run.id)
    .where(Run.name.in_(bindparam("runs", expanding=True)), Run.stop_step.is_not(None))
    .where(Rank.finished_at.is_(None))
    .where(Run.superseded_at.is_(None))  # a stop of an earlier attempt is over
)


class Commander:
    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics, send: Send) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.send = send
        self.peers: dict[bytes, Peer] = {}
        self._flight_asked: set[tuple[str, int]] = set()
        self._last_poll = time.time()
        #: The connections of the batch being handled (set by :meth:`seen`).
        self._batch: set[bytes] = set()

    def seen(self, accepted: Accepted, now: float) -> None:
        """Remember the batch's connections (a new one by its first message)."""
        idents = {ident for ident, _ in accepted}
        new = idents.difference(self.peers)
        for ident, message in accepted if new else ():
            if ident in new and ident not in self.peers:
                self.peers[ident] = Peer(message["run"], message["rank"], now)
        for ident in idents:
            self.peers[ident].seen = now
        self._batch = idents

    def after_batch(self, accepted: Accepted) -> None:
        """Answer a committed batch with the commands its senders are due
        (its connections: those :meth:`seen` was told of last)."""
        peers = [(ident, self.peers[ident]) for ident in self._batch if ident in self.peers]
        stops = self._pending_stops({peer.run for _, peer in peers})
        now = time.time()
        for ident, peer in peers if stops else ():
            target = stops.get((peer.run, peer.rank))
            if target is not None and now - peer.commanded >= COMMAND_EVERY_S:
                self._stop(ident, peer, *target, now)
        self._ask_for_flights(accepted)

    def due(self) -> bool:
        return time.time() - self._last_poll >= self.settings.poll_s

    def poll(self) -> None:
        """Push stops recorded since the last look (on any server) to peers here."""
        now = time.time()
        since, self._last_poll = self._last_poll - 1.0, now
        horizon = now - self.settings.lost_after_s
        for ident in [i for i, p in self.peers.items() if p.seen < horizon]:
            del self.peers[ident]
        try:
            with Session(self.engine) as session:
                new = store.stops_requested_since(session, since)
            stops = self._pending_stops({name for name, _, _ in new}) if new else {}
        except Exception:
            log.warning("could not look for stop requests", exc_info=True)
            return
        for ident, peer in list(self.peers.items()):
            target = stops.get((peer.run, peer.rank))
            if target is not None and now - peer.commanded >= COMMAND_EVERY_S:
                self._stop(ident, peer, target[0], target[1], now)

    def _stop(self, ident: bytes, peer: Peer, step: int, reason: str, now: float) -> None:
        self.send(ident, {"kind": "command", "command": "stop", "step": step, "reason": reason})
        peer.commanded = now
        self.metrics.command_sent()

    def _pending_stops(self, runs: set[str]) -> dict[tuple[str, int], tuple[int, str]]:
        """(run, rank) → (stop step, reason) for ranks of these runs that have not said bye."""
        if not runs:
            return {}
        with self.engine.connect() as conn:  # (a batch's worth: no ORM session)
            rows = conn.execute(_PENDING_STOPS, {"runs": list(runs)}).all()
        return {(name, rank): (int(step or 0), reason) for name, rank, step, reason in rows}

    def _ask_for_flights(self, accepted: Accepted) -> None:
        wanted: dict[tuple[str, int], bytes] = {}
        for ident, message in accepted:
            if message["kind"] != "event" or message["body"].get("flight"):
                continue  # (the usual case, told first: once a message, full rate)
            key = (message["run"], message["rank"])
            if key not in self._flight_asked:
                wanted[key] = ident
        if not wanted:
            return
        statement = (
            select(Run.name, Flight.rank)
            .join(Flight, Flight.run_id == Run.id)
            .where(tuple_(Run.name, Flight.rank).in_(list(wanted)), Run.superseded_at.is_(None))
            .distinct()
        )
        with Session(self.engine) as session:
            have = {(name, rank) for name, rank in session.execute(statement)}
        if len(self._flight_asked) > MAX_FLIGHT_ASKED:
            self._flight_asked.clear()  # a flood of new ranks; at worst one more ask each
        for key, ident in wanted.items():
            self._flight_asked.add(key)
            if key not in have:
                self.send(ident, {"kind": "command", "command": "send_flight"})
                self.metrics.command_sent()
