"""How the NaN spread in a big run: each diverged rank's relation to the origin,
kept up to date from the new events only.

A rank's relation (``correlate.relation``) depends on its first event and the
origin. During an incident at 100,000 ranks every rank's received event comes
in while a scheduler polls the verdict, and classifying every diverged rank
again (one join, O(diverged): 0.7 s at 66,665 ranks) on each poll made every
poll of the incident slow. So each run's relations are kept in memory
(:data:`KNOWN`) with the highest event id there was when they were read (the
*mark*), and a verdict classifies only the ranks whose first event is newer
than the mark, in one statement that also reads the run's diverged tally and
the new mark (one snapshot). When the origin moved (a new, logically earlier
event), a rank whose agent said ``cause="received"`` stays ``received`` unless
it is at the new origin's point (or was the origin or at its point), so only
those and the ranks whose agent said otherwise are classified again. All of
them are read again when:

- the server has none for the run yet, or more than :data:`AGAIN_MAX` ranks
  would be classified again after a move of the origin;
- the ranks known differ in number from the run's tally of diverged ranks: a
  rank's first event committed after a newer one had been read (two servers on
  one PostgreSQL commit in either order), or rows were deleted.

What the count cannot see: a rank that had already diverged, whose first event
was replaced by an earlier one of its own committed after a newer event had
been read (the same rank's batches through two servers at once, a failover):
its relation stays the older one's until the server reads them all again. Everything
here is derived from the database, so any server computes the same.
``tests/server/test_spread.py`` holds the kept relations equal to a full
computation, batch after batch, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, cast

from sqlalchemy import ColumnElement, Select, and_, case, func, or_, select, true, tuple_
from sqlalchemy.orm import Session

from nand.events import Relation
from nand.server.storage.models import EventRow, Rank, Run, RunTally

#: (relation, phase of the first event, the collective its agent named) of one
#: rank; the few distinct ones are shared (a 100,000-rank run keeps a few small
#: tuple objects, not 100,000).
Kind = tuple[str, str, str]


@dataclass(frozen=True)
class Known:
    """A run's diverged ranks as last read: ``kinds`` rank -> (relation to the
    origin ``head_id``, its own rank ``origin``; phase of the first event; ``via``),
    and the
    same as ``groups``, kind -> ranks in order (what the verdict's lists and
    sentence are made of, so a few new ranks are merged in, not all sorted again);
    ``mark``: the highest event id when read; ``others``: the ranks whose agent did
    not say ``cause="received"`` (only theirs can change when the origin moves, see
    :func:`_again`); ``version``: new for new contents. Never changed once made
    (verdicts of several requests share it)."""

    head_id: int
    mark: int
    kinds: dict[int, Kind]
    groups: dict[Kind, list[int]]
    others: frozenset[int]
    version: int


#: Each run's :class:`Known`, by database, run id and start; a few runs at most.
KNOWN: dict[tuple[str, int, float], Known] = {}
KNOWN_KEPT = 4
_versions = itertools.count(1)
_shared: dict[Kind, Kind] = {}


def at_point(head: EventRow) -> ColumnElement[bool]:
    """At the origin's step, micro-step and phase: at its point, on its own
    (``correlate.same_point``: the module, or any parameter of one update; not
    received)."""
    module = EventRow.module == head.module
    here = or_(module, EventRow.phase == "param") if head.phase == "param" else module
    if head.cause == "received":
        return and_(Rank.rank == head.rank, here)
    return and_(here, or_(Rank.rank == head.rank, EventRow.cause != "received"))


def relation_of(head: EventRow) -> ColumnElement[str]:
    """A diverged rank's relation to the origin ``head`` in SQL (``correlate.relation``)."""
    key = tuple_(EventRow.step, EventRow.micro_step, EventRow.phase_rank, EventRow.ord)
    head_key = tuple_(head.step, head.micro_step, head.phase_rank, head.ord)
    same_point = and_(
        EventRow.step == head.step,
        EventRow.micro_step == head.micro_step,
        EventRow.phase_rank == head.phase_rank,
        at_point(head),
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


def known(session: Session, run: Run, head: EventRow) -> Known:
    """The run's diverged ranks and their relations to ``head`` (its origin), now."""
    run_id = run.id
    # (started_at too: SQLite may give a pruned run's id to a new one)
    where = (str(session.get_bind().engine.url), run_id, run.started_at)
    last = KNOWN.get(where)
    found = _catch_up(session, run_id, head, last) if last is not None else None
    if found is None:
        found = _read_all(session, run_id, head)
    while len(KNOWN) >= KNOWN_KEPT and where not in KNOWN:
        del KNOWN[next(iter(KNOWN))]
    KNOWN[where] = found
    return found


def groups(found: Known) -> dict[Kind, list[int]]:
    """The diverged ranks by (relation, phase, via), each in rank order: the origin's
    rank is ``simultaneous`` when others went non-finite at its point too
    (``correlate.relations_to``)."""
    first = [r for (k, *_), ranks in found.groups.items() if k in _FIRST for r in ranks]
    if len(first) <= 1:
        return found.groups
    out: dict[Kind, list[int]] = {}
    for (relation, phase, via), ranks in found.groups.items():
        kind = ("simultaneous" if relation == "origin" else relation, phase, via)
        out[kind] = sorted(out.get(kind, []) + ranks)
    return out


def relations(found: Known) -> list[tuple[int, Relation, str, str]]:
    """(rank, relation, phase of its first event, via) of every diverged rank, by rank."""
    rows = [
        (r, cast(Relation, k), p, v) for (k, p, v), ranks in groups(found).items() for r in ranks
    ]
    return sorted(rows)


_FIRST = ("origin", "simultaneous")


def _kind(relation: str, phase: str, via: str) -> Kind:
    kind = (relation, phase, via)
    return _shared.setdefault(kind, kind)


def _top() -> ColumnElement[int]:
    """The highest event id (the end of the primary key: no scan)."""
    return select(func.max(EventRow.id)).scalar_subquery()


def _read_all(session: Session, run_id: int, head: EventRow) -> Known:
    # The mark first: what the rows below read includes every event up to it.
    mark = session.scalar(select(_top())) or 0
    statement = (
        select(Rank.rank, relation_of(head), EventRow.phase, EventRow.via, EventRow.cause)
        .join(EventRow, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id)
    )
    # (Core rows, not the ORM's: a third of the time at 66,665 rows)
    rows = session.connection().execute(statement).all()
    kinds = {rank: _kind(k, phase, via) for rank, k, phase, via, _ in rows}
    others = frozenset(rank for rank, *_, cause in rows if cause != "received")
    return Known(head.id, mark, kinds, _grouped(kinds), others, next(_versions))


def _grouped(kinds: dict[int, Kind]) -> dict[Kind, list[int]]:
    out: dict[Kind, list[int]] = {}
    for rank, kind in kinds.items():
        out.setdefault(kind, []).append(rank)
    for ranks in out.values():
        ranks.sort()
    return out


#: Most ranks classified again when the origin moves (else all are read again).
AGAIN_MAX = 5_000


def _catch_up(session: Session, run_id: int, head: EventRow, last: Known) -> Known | None:
    """``last`` with the ranks whose first event is newer than its mark (and, if the
    origin moved, those whose relation may have changed: :func:`_again`); None when
    the ranks then known are not the run's diverged ranks (read them all)."""
    rows = session.connection().execute(_newer(run_id, head, last.mark)).all()
    if not rows:
        return None  # (no tally row)
    diverged, mark = rows[0][0], rows[0][1] or 0
    found = [tuple(row[2:]) for row in rows if row[2] is not None]
    if head.id != last.head_id:
        again = _again(session, run_id, head, last) - {row[0] for row in found}
        if len(again) > AGAIN_MAX:
            return None
        found += _reread(session, run_id, head, again)
    new = {rank: _kind(k, phase, via) for rank, k, phase, via, _ in found}
    said = {rank for rank, *_, cause in found if cause != "received"}
    others = frozenset((last.others - new.keys()) | said)
    changed = {rank: kind for rank, kind in new.items() if last.kinds.get(rank) is not kind}
    if len(last.kinds) + sum(1 for rank in changed if rank not in last.kinds) != diverged:
        return None
    if not changed and head.id == last.head_id:
        return replace(last, mark=mark, others=others)
    kinds = {**last.kinds, **changed}
    return Known(head.id, mark, kinds, _merged(last, changed), others, next(_versions))


def _again(session: Session, run_id: int, head: EventRow, last: Known) -> set[int]:
    """The ranks whose relation may differ under a new origin ``head``: a rank whose
    agent said ``received`` is ``received`` under any origin (``correlate.relation``)
    unless it is the origin's rank or at its point (or was, under the last one)."""
    at_point = select(Rank.rank).where(
        Rank.run_id == run_id,
        Rank.first_event_id.is_not(None),
        Rank.first_step == head.step,
        Rank.first_micro_step == head.micro_step,
        Rank.first_phase_rank == head.phase_rank,
    )  # (ix_ranks_first_key; the module is compared by the CASE)
    first = {r for (k, *_), ranks in last.groups.items() if k in _FIRST for r in ranks}
    return set(last.others) | first | set(session.scalars(at_point)) | {head.rank}


def _reread(
    session: Session, run_id: int, head: EventRow, ranks: set[int]
) -> list[tuple[Any, ...]]:
    """(rank, relation to ``head``, phase, via, cause) of those of ``ranks`` that diverged."""
    if not ranks:
        return []
    statement = (
        select(Rank.rank, relation_of(head), EventRow.phase, EventRow.via, EventRow.cause)
        .join(EventRow, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id, Rank.rank.in_(sorted(ranks)))
    )
    return [tuple(row) for row in session.connection().execute(statement)]


def _merged(last: Known, changed: dict[int, Kind]) -> dict[Kind, list[int]]:
    """``last.groups`` with the ``changed`` ranks moved to their new kind (only the
    lists touched are copied: ``last`` is shared)."""
    out = dict(last.groups)
    moved = {rank: last.kinds[rank] for rank in changed if rank in last.kinds}
    for kind in set(moved.values()):
        out[kind] = [r for r in out[kind] if r not in moved]
    added: dict[Kind, list[int]] = {}
    for rank, kind in changed.items():
        added.setdefault(kind, []).append(rank)
    for kind, ranks in added.items():
        # (sorted runs: the sort merges them in linear time)
        out[kind] = sorted(out.get(kind, []) + sorted(ranks))
    return out


def _newer(run_id: int, head: EventRow, mark: int) -> Select[Any]:
    """The run's diverged tally, the highest event id, and the ranks whose first
    event is newer than ``mark`` with their relation and phase: one statement, one
    snapshot (the tally and the mark agree with the rows; one row of nulls if none)."""
    newer = (
        select(
            Rank.rank.label("rank"),
            relation_of(head).label("k"),
            EventRow.phase,
            EventRow.via,
            EventRow.cause,
        )
        .join(
            Rank,
            and_(
                Rank.run_id == EventRow.run_id,
                Rank.rank == EventRow.rank,
                Rank.first_event_id == EventRow.id,
            ),
        )
        # (+ 0: the run's events by the primary key's range, not by an index on run_id)
        .where(EventRow.id > mark, EventRow.run_id + 0 == run_id)
        .subquery()
    )
    return (
        select(RunTally.diverged, _top(), *newer.c)
        .select_from(RunTally)
        .outerjoin(newer, true())
        .where(RunTally.run_id == run_id)
    )
