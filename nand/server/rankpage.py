"""``GET /api/runs/{run}/ranks``: a page of a run's ranks, and counts over all of them.

A 20,000-rank run's full list was 13 MB and took seconds to build, so the list
comes a page at a time, in rank order, keyed by rank (``after``): a rank that
reports while a client pages is never listed twice. What a rank's relation
depends on is read without loading every rank: the origin is the least cached
first key over the rank rows (one indexed query), and whether another rank
went non-finite at the same point is one more. The counts by state read a few
columns of every rank row, no event. :func:`run_summary` builds a run's
summary the same way (what the event streams' poller sends for a big run).
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from nand.events import RankState, Relation
from nand.server import correlate, losses, runsummary, store, views
from nand.server.failures import RankFacts
from nand.server.models import EventRow, Rank, Run
from nand.server.runsummary import RunFacts
from nand.server.schemas import RankPage, RunSummary
from nand.server.settings import Settings


def rank_page(
    session: Session, run: Run, settings: Settings, now: float, after: int | None, limit: int
) -> RankPage:
    """The ranks above ``after`` (all when None), at most ``limit`` of them."""
    rows = _page_rows(session, run.id, after, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    states = _state_counts(session, run.id, settings, now)
    relations = _relations(session, run.id, [e for _, e in rows if e is not None])
    flights = store.ranks_with_flight(session, run.id)
    items = views.rank_statuses(run, rows, settings, now, flights, relations)
    return RankPage(
        items=items,
        total=sum(states.values()),
        limit=limit,
        next_after=rows[-1][0].rank if more else None,
        states=states,
    )


def _page_rows(
    session: Session, run_id: int, after: int | None, limit: int
) -> list[tuple[Rank, EventRow | None]]:
    statement = (
        select(Rank, EventRow)
        .outerjoin(EventRow, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id)
        .order_by(Rank.rank)
        .limit(limit)
    )
    if after is not None:
        statement = statement.where(Rank.rank > after)
    return [(rank, event) for rank, event in session.execute(statement).all()]


def _state_counts(
    session: Session, run_id: int, settings: Settings, now: float
) -> dict[RankState, int]:
    facts = RunFacts(_rank_facts(session, run_id))
    return dict(Counter(runsummary.rank_states(facts, settings, now).values()))


def _rank_facts(session: Session, run_id: int) -> list[RankFacts]:
    """Every rank's facts from a few columns of its row (no event, no ORM object)."""
    statement = select(
        Rank.rank,
        Rank.step,
        Rank.last_seen,
        Rank.step_changed_at,
        Rank.first_event_id.is_not(None),
        Rank.finished_at,
        Rank.bye_reason,
        Rank.steps_per_s,
        Rank.dropped,
    ).where(Rank.run_id == run_id)
    return [
        RankFacts(
            rank=rank,
            step=step,
            last_seen=last_seen,
            step_changed_at=changed,
            diverged=bool(diverged),
            finished_at=finished_at,
            bye_reason=bye or "",
            steps_per_s=steps_per_s,
            dropped=losses.counts(dropped),
        )
        for rank, step, last_seen, changed, diverged, finished_at, bye, steps_per_s, dropped in (
            session.execute(statement)
        )
    ]


def _origin(session: Session, run_id: int) -> EventRow | None:
    """The least cached first event of the run's ranks (ties: the lowest rank)."""
    statement = (
        select(EventRow)
        .join(Rank, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id)
        .order_by(
            Rank.first_step,
            Rank.first_micro_step,
            Rank.first_phase_rank,
            Rank.first_order,
            Rank.rank,
        )
        .limit(1)
    )
    return session.scalars(statement).first()


def _same_point(session: Session, run_id: int, head: EventRow) -> list[int]:
    """The ranks whose first event is at the origin's point (the origin's among them)."""
    statement = (
        select(Rank.rank)
        .join(EventRow, EventRow.id == Rank.first_event_id)
        .where(
            and_(
                Rank.run_id == run_id,
                Rank.first_step == head.step,
                Rank.first_micro_step == head.micro_step,
                Rank.first_phase_rank == head.phase_rank,
                EventRow.module == head.module,
            )
        )
        .order_by(Rank.rank)
    )
    return list(session.scalars(statement))


def _relations(session: Session, run_id: int, firsts: list[EventRow]) -> dict[int, Relation]:
    head = _origin(session, run_id)
    if head is None or not firsts:
        return {}
    together = len(_same_point(session, run_id, head)) > 1
    return correlate.relations_to(
        [views.to_event(e) for e in firsts], views.to_event(head), together
    )


def run_facts(session: Session, run: Run) -> RunFacts:
    """A run's facts without loading every rank row and first event."""
    head = _origin(session, run.id)
    together = _same_point(session, run.id, head) if head is not None else []
    return RunFacts(_rank_facts(session, run.id), head, together)


def run_summary(session: Session, run: Run, settings: Settings, now: float) -> RunSummary:
    """The run's summary (``runsummary.build``) from :func:`run_facts`."""
    return runsummary.build(run, run_facts(session, run), settings, now)
