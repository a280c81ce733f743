"""One database poll per interval for every event stream, fanned out.

Each ``GET /api/stream`` connection is a :class:`Subscriber` of the server's
:class:`StreamHub`. While anyone is subscribed, one task polls the database
every ``poll_s`` (0.5 s) for the runs that changed since its last look, plus
the runs seen recently enough that their state may age into ``lost`` or
``stalled``; it builds each summary once and offers it to every subscriber.
A hundred dashboards and a hundred ``nand wait`` cost one query per interval,
not two hundred. When every subscriber follows named runs (``?run=``), the
poll reads only those.

A subscriber's mailbox keeps at most the latest summary per run: a client
that reads slowly skips intermediate states, and memory stays bounded by the
number of runs. A new subscriber gets its first summaries from a snapshot
query (the first message per run comes at once; subscribers arriving together
share one), and poll results that arrive while it is taken win over it. A
poll that took long pushes the next one back, so the poller spends at most
half its time in the database.

>>> import asyncio
>>> sub = Subscriber("r1")
>>> sub.offer([Update("r1", "k1", "{}"), Update("r2", "k1", "{}")])
>>> [u.run for u in sub.take()], sub.take()
(['r1'], [])
>>> sub.offer([Update("r1", "k1", "{}")])  # the same summary again: nothing to send
>>> sub.take()
[]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nand.server.analysis import reads
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Run

log = logging.getLogger("nand.server")

#: A snapshot younger than this is shared with a new subscriber of the same filter.
SHARE_S = 0.5
#: Runs a new unfiltered subscriber is sent at once (most recently seen first).
INITIAL_RUNS = 200


@dataclass(frozen=True)
class Update:
    """One run's summary: ``key`` is what decides whether it changed (no ``last_seen``)."""

    run: str
    key: str
    body: str


@dataclass(eq=False)
class Subscriber:
    """One stream: what it follows, what it was sent, and its bounded mailbox."""

    run: str | None
    sent: dict[str, str] = field(default_factory=dict)
    pending: dict[str, Update] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, updates: Iterable[Update], *, only_new: bool = False) -> None:
        """Keep the latest of each run that differs from what was sent; ``only_new``
        (a snapshot): skip runs a poll has already offered, those are newer."""
        for update in updates:
            if self.run is not None and update.run != self.run:
                continue
            if only_new and (update.run in self.pending or update.run in self.sent):
                continue
            if self.sent.get(update.run) != update.key:
                self.pending[update.run] = update
            else:
                self.pending.pop(update.run, None)  # back to what the client has
        if self.pending:
            self.wake.set()

    def take(self) -> list[Update]:
        """The updates to send now, marked as sent."""
        out = list(self.pending.values())
        self.pending.clear()
        self.wake.clear()
        for update in out:
            self.sent[update.run] = update.key
        return out


class StreamHub:
    """The server's one poller; ``subscribe``/``unsubscribe`` per stream."""

    def __init__(
        self, engine: Engine, settings: Settings, on_poll: Callable[[], None] | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.subscribers: set[Subscriber] = set()
        self._task: asyncio.Task[None] | None = None
        self._snapshots: dict[str | None, tuple[float, asyncio.Future[list[Update]]]] = {}
        self._on_poll = on_poll

    async def subscribe(self, run: str | None) -> Subscriber:
        """Register first, then take the snapshot: a poll meanwhile is not missed."""
        subscriber = Subscriber(run)
        self.subscribers.add(subscriber)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll_loop(), name="nand-stream-poller")
        try:
            snapshot = await self._shared_snapshot(run)
        except BaseException:
            self.unsubscribe(subscriber)
            raise
        subscriber.offer(snapshot, only_new=True)
        return subscriber

    async def _shared_snapshot(self, run: str | None) -> list[Update]:
        """Subscribers arriving together (every dashboard reconnecting after a
        restart) share one snapshot, if it began under ``SHARE_S`` ago: a poll's
        1 s overlap still covers what was committed since it began."""
        now = time.time()
        shared = self._snapshots.get(run)
        if shared is None or shared[1].done() or now - shared[0] > SHARE_S:
            task = asyncio.ensure_future(run_in_threadpool(self._snapshot, run, now))
            self._snapshots[run] = shared = (now, task)
            task.add_done_callback(lambda _t: self._forget(run, task))
        return await asyncio.shield(shared[1])

    def _forget(self, run: str | None, task: asyncio.Future[list[Update]]) -> None:
        if run in self._snapshots and self._snapshots[run][1] is task:
            del self._snapshots[run]

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)

    async def close(self) -> None:
        """Stop polling and wake every subscriber (the server is shutting down)."""
        for subscriber in list(self.subscribers):
            subscriber.wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll_loop(self) -> None:
        since = time.time() - 1.0
        while self.subscribers:
            started = time.time()
            try:
                updates = await run_in_threadpool(self._poll, since, started, self._names())
            except Exception as exc:  # the database is down: keep the streams, retry
                log.warning("event stream poll failed: %s", exc)
                updates = []
            else:
                since = started - 1.0  # overlap: a commit may land during the query
            if self._on_poll is not None:
                self._on_poll()
            for subscriber in list(self.subscribers):
                subscriber.offer(updates)
            took = time.time() - started
            await asyncio.sleep(max(self.settings.poll_s - took, took))

    def _names(self) -> set[str] | None:
        """The runs followed by name, or None when some subscriber wants every run."""
        names = {s.run for s in self.subscribers}
        return None if None in names else {n for n in names if n is not None}

    def _poll(self, since: float, now: float, names: set[str] | None) -> list[Update]:
        horizon = max(self.settings.lost_after_s, self.settings.stalled_after_s) + 5.0
        with Session(self.engine) as session:
            runs = store.runs_updated_since(session, since, now - horizon, names)
            return self._updates(session, runs, now)

    def _snapshot(self, run: str | None, now: float) -> list[Update]:
        with Session(self.engine) as session:
            if run is not None:
                found = store.run_by_name(session, run)
                runs: Sequence[Run] = [found] if found is not None else []
            else:
                runs = store.recent_runs(session, INITIAL_RUNS)
            return self._updates(session, runs, now)

    def _updates(self, session: Session, runs: Sequence[Run], now: float) -> list[Update]:
        """Small runs' summaries from one query of all their ranks; a big run's
        from queries that do not load every rank (a 20,000-rank run: ~1 s less)."""
        updates = []
        for summary in reads.summaries(session, self.settings, runs, now):
            key = summary.model_dump_json(exclude={"last_seen"})
            updates.append(Update(summary.run, key, summary.model_dump_json()))
        return updates
