"""A run of thousands of ranks, summarised without reading every rank row: counts
by state, the failing ranks and each diverged rank's relation.

``views.verdict`` loads every rank row and its first event: 1.4 s at 20,000
ranks. Here the counts by state are the run's tally kept by the ingest and two
indexed range counts (:mod:`nand.server.analysis.counts`); only the ranks that
failed (lost, crashed, stalled) come back as rows, each kind from an index; the
origin is the least cached first key (``ix_ranks_first_key``, its first
entry); and each diverged rank's relation to it is a ``CASE``
(``correlate.relation``), read once per new event (:data:`SPREAD`). The number
of statements does not depend on the number of ranks, nor, between events,
the rows they read (failing ranks aside). The answer is the one
``views.verdict`` gives (``tests/server/test_big_runs.py`` holds them equal);
the API takes this path for a run of more than ``Settings.big_run_ranks``
ranks.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import ColumnElement, ScalarSelect, Select, and_, case, or_, select, tuple_
from sqlalchemy.orm import Session

from nand.events import Relation
from nand.server.analysis import (
    alerts,
    correlate,
    counts,
    losses,
    replicas,
    runsummary,
    summary,
    views,
)
from nand.server.analysis.failures import RankFacts
from nand.server.analysis.origins import origin_out, to_event
from nand.server.http.schemas import RunDetail, RunSummary, Verdict
from nand.server.settings import Settings
from nand.server.storage.models import EventRow, Rank, Run

#: The columns of a rank row that :func:`facts` reads (also rankpage's, for small runs).
FACT_COLUMNS = counts.FACT_COLUMNS


def failing_facts(
    session: Session,
    run_id: int,
    settings: Settings,
    now: float,
    tally: counts.StateCounts,
    also: int | None = None,
) -> list[RankFacts]:
    """The facts of the ranks that failed (and of rank ``also``: the origin's)."""
    crashed = tally.states.get("crashed", 0) > 0
    rows = counts.failing_ranks(session, run_id, settings, now, crashed, also)
    return [facts(*row) for row in rows]


def facts(*row: Any) -> RankFacts:
    """A rank's facts from the row of :data:`FACT_COLUMNS`."""
    rank, step, last_seen, changed, diverged, finished, bye, rate, dropped = row
    return RankFacts(
        rank=rank,
        step=step,
        last_seen=last_seen,
        step_changed_at=changed,
        diverged=bool(diverged),
        finished_at=finished,
        bye_reason=bye or "",
        steps_per_s=rate,
        dropped=losses.counts(dropped),
    )


def origin(session: Session, run_id: int) -> EventRow | None:
    """The least cached first event of the run's ranks (ties: the lowest rank)."""
    statement = (
        select(EventRow)
        .join(Rank, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id, Rank.first_event_id.is_not(None))  # (ix_ranks_first_key)
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


def same_point(session: Session, run_id: int, head: EventRow) -> list[int]:
    """The ranks whose first event is at the origin's point (the origin's among them)."""
    statement = (
        select(Rank.rank)
        .join(EventRow, EventRow.id == Rank.first_event_id)
        .where(
            and_(
                Rank.run_id == run_id,
                Rank.first_event_id.is_not(None),
                Rank.first_step == head.step,
                Rank.first_micro_step == head.micro_step,
                Rank.first_phase_rank == head.phase_rank,
                EventRow.module == head.module,
            )
        )
    )
    # (sorted here: an ORDER BY rank would walk the run's ranks by ix_ranks_run_rank)
    return sorted(session.scalars(statement))


def relation_of(head: EventRow) -> ColumnElement[str]:
    """A diverged rank's relation to the origin ``head`` in SQL (``correlate.relation``)."""
    key = tuple_(EventRow.step, EventRow.micro_step, EventRow.phase_rank, EventRow.ord)
    head_key = tuple_(head.step, head.micro_step, head.phase_rank, head.ord)
    same_point = and_(
        EventRow.step == head.step,
        EventRow.micro_step == head.micro_step,
        EventRow.phase_rank == head.phase_rank,
        EventRow.module == head.module,
    )
    through = or_(
        and_(EventRow.phase == "grad", key > head_key, EventRow.step == head.step),
        and_(EventRow.phase == "forward", EventRow.step > head.step),
    )
    return case(
        (Rank.rank == head.rank, "origin"),
        (same_point, "simultaneous"),
        (or_(EventRow.cause == "received", through), "received"),
        else_="produced",
    )


def relations(
    session: Session, run_id: int, head: EventRow
) -> list[tuple[int, Relation, str, str]]:
    """(rank, relation, phase of its first event, the collective it named) of
    every diverged rank, by rank."""
    statement = (
        select(Rank.rank, relation_of(head), EventRow.phase, EventRow.via)
        .join(EventRow, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id)
        .order_by(Rank.rank)
    )
    rows = session.execute(statement)
    found = [(rank, cast(Relation, k), phase, via) for rank, k, phase, via in rows]
    if sum(1 for _, r, _, _ in found if r in ("origin", "simultaneous")) > 1:
        # The origin's rank was only the lowest of those at the point (correlate.relations_to).
        found = [(r, "simultaneous" if k == "origin" else k, p, v) for r, k, p, v in found]
    return found


def verdict(session: Session, run: Run, settings: Settings, now: float) -> Verdict:
    """``views.verdict`` of a big run, from the statements above."""
    settings = settings.for_world(run.world_size)
    head = origin(session, run.id)
    tally = counts.state_counts(session, run, settings, now)
    ranks = failing_facts(session, run.id, settings, now, tally, head.rank if head else None)
    together = same_point(session, run.id, head) if head is not None else []
    facts = runsummary.RunFacts(ranks, head, together)
    states = runsummary.rank_states(facts, settings, now)
    found = runsummary.failures_of(facts, states, settings)
    # (run_state reads which states occur, not which rank is in which)
    state = runsummary.run_state(run, found, dict(enumerate(tally.states)))
    common = _common(session, run, state, found, tally.live, settings)
    if head is None:
        failed = views.failures_text(found, settings, "")
        text = views.joined(views.replica_text(run, state), failed)
        # (a rank's step only grows, as the run's latest does: the same maximum)
        calm = summary.calm_summary(state, [run.latest_step] * tally.ranks)
        return Verdict(**common, summary=text or calm)
    return _diverged(session, run, head, together, common, found, state, settings, tally.ranks)


def _common(
    session: Session, run: Run, state: str, found: list, live: int, settings: Settings
) -> dict[str, Any]:
    gaps = losses.per_rank(session.scalars(with_drops(run.id)))
    return {
        "run": run.name,
        **views.attempt_fields(run),
        "state": state,
        "failures": [views.failure_out(f) for f in found],
        "stop": views.stop_info(run, _stopped_steps(session, run)),
        "stoppable": run.superseded_at is None and live > 0,
        "replica": replicas.check(run),
        "warnings": alerts.summary(session, run),
        "messages_dropped": losses.total(summed := losses.summed(gaps.values())),
        "dropped": summed,
        "ranks_with_gaps": sorted(gaps),
        "gaps_summary": losses.sentence(gaps),
    }


def with_drops(run_id: int) -> Select[Rank]:
    """The run's ranks that reported losses (``ix_ranks_dropped``)."""
    return select(Rank).where(Rank.run_id == run_id, Rank.dropped.is_not(None))


def _stopped_steps(session: Session, run: Run) -> list[int]:
    if run.stop_step is None:
        return []
    statement = select(Rank.step, Rank.bye_reason).where(
        Rank.run_id == run.id, Rank.bye_reason.contains("StopRequested")
    )
    return [step for step, bye in session.execute(statement) if correlate.stopped_bye(bye or "")]


def _diverged(
    session: Session,
    run: Run,
    head_row: EventRow,
    together: list[int],
    common: dict[str, Any],
    found: list,
    state: str,
    settings: Settings,
    ranks_seen: int,
) -> Verdict:
    head = to_event(head_row)
    evidence = views.origin_evidence(session, run.id, head)
    hint = correlate.hint(head, evidence)
    world = max(run.world_size, ranks_seen)
    device = session.scalar(select(Rank.device).where(Rank.id == _rank_id(run.id, head.rank)))
    where = str(session.get_bind().engine.url)
    key = (where, run.id, run.event_count, head_row.id, world, hint, repr(evidence), device or "")
    if key not in SPREAD:
        _remember(key, _spread(session, run.id, head_row, key))
    affected, received, simultaneous, nonfinite = SPREAD[key]
    return Verdict(
        **common,
        origin=origin_out(head_row, [], together),
        ranks_affected=affected,
        ranks_received=received,
        simultaneous=simultaneous,
        hint=hint,
        summary=views.joined(
            views.replica_text(run, state), views.failures_text(found, settings, nonfinite)
        ),
        since=head.time,
    )


Spread = tuple[list[int], list[int], bool, str]
#: How the NaN spread (every diverged rank's relation, in lists and words), by run,
#: its event count, origin, world size, hint, evidence and the origin's device: it
#: changes only with a new event, and a scheduler polls the verdict of a 100,000-rank
#: run between events. Derived from the database (any server computes the same).
SPREAD: dict[tuple[Any, ...], Spread] = {}
SPREAD_KEPT = 8


def _remember(key: tuple[Any, ...], spread: Spread) -> None:
    while len(SPREAD) >= SPREAD_KEPT:
        del SPREAD[next(iter(SPREAD))]
    SPREAD[key] = spread


def _spread(session: Session, run_id: int, head_row: EventRow, key: tuple[Any, ...]) -> Spread:
    *_, world, hint, _, device = key
    rows = relations(session, run_id, head_row)
    rel = {rank: relation for rank, relation, _, _ in rows}
    phases = [(rank, phase, via) for rank, _, phase, via in rows]
    head = to_event(head_row)
    evidence = views.origin_evidence(session, run_id, head)
    sentence = summary.diverged_sentence(head, rel, phases, world, hint, evidence, device)
    received = [r for r, k in rel.items() if k == "received"]
    return sorted(rel), received, any(k == "simultaneous" for k in rel.values()), sentence


def _rank_id(run_id: int, rank: int) -> ScalarSelect[int]:
    return select(Rank.id).where(Rank.run_id == run_id, Rank.rank == rank).scalar_subquery()


def run_detail(session: Session, run: Run, settings: Settings, now: float) -> RunDetail:
    """``views.run_detail`` of a big run: its summary is read off its verdict."""
    found = verdict(session, run, settings, now)
    gaps = losses.per_rank(session.scalars(with_drops(run.id)))
    ranks_seen = counts.ranks_seen(session, run.id)
    summary_ = RunSummary(
        run=run.name,
        **views.attempt_fields(run),
        state=found.state,
        world_size=max(run.world_size, ranks_seen),
        ranks_seen=ranks_seen,
        latest_step=run.latest_step,
        started_at=run.started_at,
        last_seen=run.last_seen,
        event_count=run.event_count,
        warnings=run.warning_count,
        origin=found.origin,
        messages_dropped=found.messages_dropped,
        dropped=found.dropped,
    )
    return views.detail_of(session, run, summary_, found, gaps)
