"""A run of thousands of ranks, summarised without reading every rank row: counts
by state, the failing ranks and each diverged rank's relation.

``views.verdict`` loads every rank row and its first event: 1.4 s at 20,000
ranks. Here the counts by state are the run's tally kept by the ingest and two
indexed range counts (:mod:`nand.server.analysis.counts`); only the ranks that
failed (lost, crashed, stalled) come back as rows, each kind from an index; the
origin is the least cached first key (``ix_ranks_first_key``, its first
entry); and each diverged rank's relation to it is a ``CASE``
(``correlate.relation``), kept from verdict to verdict and read for the ranks
with new events only (:mod:`nand.server.analysis.spread`). The number of
statements does not depend on the number of ranks, nor the rows they read
(failing ranks aside; all diverged ranks when the origin moves). The answer is the one
``views.verdict`` gives (``tests/server/test_big_runs.py`` holds them equal);
the API takes this path for a run of more than ``Settings.big_run_ranks``
ranks.
"""

from __future__ import annotations

import itertools
from typing import Any

from sqlalchemy import ScalarSelect, Select, and_, select
from sqlalchemy.orm import Session

from nand.events import Event
from nand.server.analysis import (
    alerts,
    correlate,
    counts,
    losses,
    replicas,
    runsummary,
    spread,
    summary,
    views,
)
from nand.server.analysis.evidence import FlightEvidence
from nand.server.analysis.failures import RankFacts
from nand.server.analysis.origins import origin_out, to_event
from nand.server.schemas.runs import RunDetail, RunSummary
from nand.server.schemas.verdict import Verdict
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
            EventRow.cause == "received",  # (ties: one not received first, correlate.origin)
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
                spread.at_point(head),
            )
        )
    )
    # (sorted here: an ORDER BY rank would walk the run's ranks by ix_ranks_run_rank)
    return sorted(session.scalars(statement))


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
    known = spread.known(session, run, head_row)
    key = (known.version, world, hint, repr(evidence), device or "")
    if key not in SPREAD:
        _remember(key, _spread(known, head, world, hint, evidence, device or ""))
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
#: How the NaN spread in lists and words, by the run's :class:`spread.Known`
#: relations, world size, hint, evidence and the origin's device: the relations
#: are kept up to date from the new events (:mod:`nand.server.analysis.spread`),
#: and a scheduler polls the verdict of a 100,000-rank run between events.
SPREAD: dict[tuple[Any, ...], Spread] = {}
SPREAD_KEPT = 8


def _remember(key: tuple[Any, ...], found: Spread) -> None:
    while len(SPREAD) >= SPREAD_KEPT:
        del SPREAD[next(iter(SPREAD))]
    SPREAD[key] = found


def _spread(
    known: spread.Known,
    head: Event,
    world: int,
    hint: str,
    evidence: FlightEvidence | None,
    device: str,
) -> Spread:
    groups = spread.groups(known)
    sentence = summary.diverged_sentence(head, groups, world, hint, evidence, device)
    # (merging sorted runs: linear, in C)
    affected = sorted(itertools.chain.from_iterable(groups.values()))
    received = sorted(itertools.chain(*(r for (k, *_), r in groups.items() if k == "received")))
    simultaneous = any(ranks for (k, *_), ranks in groups.items() if k == "simultaneous")
    return affected, received, simultaneous, sentence


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
