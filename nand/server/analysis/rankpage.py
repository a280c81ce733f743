"""``GET /api/runs/{run}/ranks``: a page of a run's ranks, and counts over all of them.

A 20,000-rank run's full list was 13 MB and took seconds to build, so the list
comes a page at a time, in rank order, keyed by rank (``after``): a rank that
reports while a client pages is never listed twice. What a rank's relation
depends on is read without loading every rank: the origin is the least cached
first key over the rank rows (one indexed query), and whether another rank
went non-finite at the same point is one more. The counts by state are the
run's tally kept by the ingest and two indexed range counts
(:mod:`nand.server.analysis.counts`): no request reads every rank row.
:func:`run_summary` builds a run's summary the same way (what the event
streams' poller sends for a big run).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import FromClause, select
from sqlalchemy.orm import Session

from nand.events import Event, Relation
from nand.server.analysis import bigrun, correlate, counts, losses, runsummary, views
from nand.server.analysis.runsummary import RunFacts
from nand.server.schemas.ranks import RankPage
from nand.server.schemas.runs import RunSummary
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import EventRow, Rank, Run


def rank_page(
    session: Session, run: Run, settings: Settings, now: float, after: int | None, limit: int
) -> RankPage:
    """The ranks above ``after`` (all when None), at most ``limit`` of them."""
    settings = settings.for_world(run.world_size)
    rows = _page_rows(session, run.id, after, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    counted = counts.state_counts(session, run, settings, now)
    page = (rows[0][0].rank, rows[-1][0].rank) if rows else (0, -1)
    flights = store.ranks_with_flight(session, run.id, page)
    items = views.rank_statuses(
        run, rows, settings, now, flights, lambda firsts: _relations(session, run.id, firsts)
    )
    return RankPage(
        items=items,
        total=counted.ranks,
        limit=limit,
        next_after=rows[-1][0].rank if more else None,
        states=counted.states,
    )


def _plain(table: FromClause) -> Callable[[Iterable[Any]], Any]:
    """Rows of ``table`` as plain named tuples, whose attributes are the column
    names: the views read them like the ORM objects (no attribute is renamed)."""
    plain: Any = namedtuple("Row", [column.name for column in table.c])  # type: ignore[misc]
    return plain._make


_rank_tuple = _plain(Rank.__table__)
_event_tuple = _plain(EventRow.__table__)


def _page_rows(session: Session, run_id: int, after: int | None, limit: int) -> views.RankRows:
    """The page's rank rows and first events, as plain tuples: 500 ORM objects
    of each were a third of a page's time (made, then every attribute read
    through the ORM's instrumentation)."""
    statement = select(*Rank.__table__.c).where(Rank.run_id == run_id)
    if after is not None:
        statement = statement.where(Rank.rank > after)
    ranks = [
        _rank_tuple(row) for row in session.execute(statement.order_by(Rank.rank).limit(limit))
    ]
    ids = [rank.first_event_id for rank in ranks if rank.first_event_id is not None]
    firsts: dict[int, Any] = {}
    if ids:
        events = session.execute(select(*EventRow.__table__.c).where(EventRow.id.in_(ids)))
        firsts = {event.id: _event_tuple(event) for event in events}
    return [(rank, firsts.get(rank.first_event_id)) for rank in ranks]


def _relations(session: Session, run_id: int, firsts: list[Event]) -> dict[int, Relation]:
    head = bigrun.origin(session, run_id)
    if head is None or not firsts:
        return {}
    together = len(bigrun.same_point(session, run_id, head)) > 1
    return correlate.relations_to(firsts, views.to_event(head), together)


def run_summary(session: Session, run: Run, settings: Settings, now: float) -> RunSummary:
    """The run's summary (``runsummary.build``) from its failing ranks, origin and
    tally: the same as from every rank (``tests/server/test_scale.py``)."""
    counted = settings.for_world(run.world_size)
    head = bigrun.origin(session, run.id)
    tally = counts.state_counts(session, run, counted, now)
    also = head.rank if head is not None else None
    failing = bigrun.failing_facts(session, run.id, counted, now, tally, also)
    together = bigrun.same_point(session, run.id, head) if head is not None else []
    gaps = losses.per_rank(session.scalars(bigrun.with_drops(run.id)))
    seen = runsummary.Seen(tally.ranks, set(tally.states), losses.summed(gaps.values()))
    return runsummary.build(run, RunFacts(failing, head, together), settings, now, seen)
