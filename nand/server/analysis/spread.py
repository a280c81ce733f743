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
the new mark (one snapshot). All of them are read again when:

- the origin moved (a new, logically earlier event: every relation may change),
  or the server has none for the run yet;
- the ranks known differ in number from the run's tally of diverged ranks: a
  rank's first event committed after a newer one had been read (two servers on
  one PostgreSQL commit in either order), or rows were deleted.

What the count cannot see: a rank that had already diverged, whose first event
was replaced by an earlier one of its own committed after a newer event had
been read (the same rank's batches through two servers at once, a failover):
its relation stays the older one's until the origin next moves. Everything
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

#: (relation, phase of the first event) of one rank; the few distinct ones are
#: shared (a 100,000-rank run keeps one small tuple object, not 100,000).
Kind = tuple[str, str]


@dataclass(frozen=True)
class Known:
    """A run's diverged ranks as last read: ``kinds`` rank -> (relation to the
    origin ``head_id``, its own rank ``origin``; phase of the first event), and the
    same as ``groups``, kind -> ranks in order (what the verdict's lists and
    sentence are made of, so a few new ranks are merged in, not all sorted again);
    ``mark``: the highest event id when read; ``version``: new for new contents.
    Never changed once made (verdicts of several requests share it)."""

    head_id: int
    mark: int
    kinds: dict[int, Kind]
    groups: dict[Kind, list[int]]
    version: int


#: Each run's :class:`Known`, by database, run id and start; a few runs at most.
KNOWN: dict[tuple[str, int, float], Known] = {}
KNOWN_KEPT = 4
_versions = itertools.count(1)
_shared: dict[Kind, Kind] = {}


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


def known(session: Session, run: Run, head: EventRow) -> Known:
    """The run's diverged ranks and their relations to ``head`` (its origin), now."""
    run_id = run.id
    # (started_at too: SQLite may give a pruned run's id to a new one)
    where = (str(session.get_bind().engine.url), run_id, run.started_at)
    last = KNOWN.get(where)
    found = None
    if last is not None and last.head_id == head.id:
        found = _catch_up(session, run_id, head, last)
    if found is None:
        found = _read_all(session, run_id, head)
    while len(KNOWN) >= KNOWN_KEPT and where not in KNOWN:
        del KNOWN[next(iter(KNOWN))]
    KNOWN[where] = found
    return found


def groups(found: Known) -> dict[Kind, list[int]]:
    """The diverged ranks by (relation, phase), each in rank order: the origin's
    rank is ``simultaneous`` when others went non-finite at its point too
    (``correlate.relations_to``)."""
    first = [r for (k, _), ranks in found.groups.items() if k in _FIRST for r in ranks]
    if len(first) <= 1:
        return found.groups
    out: dict[Kind, list[int]] = {}
    for (relation, phase), ranks in found.groups.items():
        kind = ("simultaneous", phase) if relation == "origin" else (relation, phase)
        out[kind] = sorted(out.get(kind, []) + ranks)
    return out


def relations(found: Known) -> list[tuple[int, Relation, str]]:
    """(rank, relation, phase of its first event) of every diverged rank, by rank."""
    rows = [(r, cast(Relation, k), p) for (k, p), ranks in groups(found).items() for r in ranks]
    return sorted(rows)


_FIRST = ("origin", "simultaneous")


def _kind(relation: str, phase: str) -> Kind:
    kind = (relation, phase)
    return _shared.setdefault(kind, kind)


def _top() -> ColumnElement[int]:
    """The highest event id (the end of the primary key: no scan)."""
    return select(func.max(EventRow.id)).scalar_subquery()


def _read_all(session: Session, run_id: int, head: EventRow) -> Known:
    # The mark first: what the rows below read includes every event up to it.
    mark = session.scalar(select(_top())) or 0
    statement = (
        select(Rank.rank, relation_of(head), EventRow.phase)
        .join(EventRow, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id == run_id)
    )
    # (Core rows, not the ORM's: a third of the time at 66,665 rows)
    rows = session.connection().execute(statement)
    kinds = {rank: _kind(k, phase) for rank, k, phase in rows}
    return Known(head.id, mark, kinds, _grouped(kinds), next(_versions))


def _grouped(kinds: dict[int, Kind]) -> dict[Kind, list[int]]:
    out: dict[Kind, list[int]] = {}
    for rank, kind in kinds.items():
        out.setdefault(kind, []).append(rank)
    for ranks in out.values():
        ranks.sort()
    return out


def _catch_up(session: Session, run_id: int, head: EventRow, last: Known) -> Known | None:
    """``last`` with the ranks whose first event is newer than its mark; None when
    the ranks then known are not the run's diverged ranks (read them all)."""
    rows = session.connection().execute(_newer(run_id, head, last.mark)).all()
    if not rows:
        return None  # (no tally row)
    diverged, mark = rows[0][0], rows[0][1] or 0
    new = {rank: _kind(k, phase) for _, _, rank, k, phase in rows if rank is not None}
    changed = {rank: kind for rank, kind in new.items() if last.kinds.get(rank) is not kind}
    if len(last.kinds) + sum(1 for rank in changed if rank not in last.kinds) != diverged:
        return None
    if not changed:
        return last if mark == last.mark else replace(last, mark=mark)
    kinds = {**last.kinds, **changed}
    return Known(last.head_id, mark, kinds, _merged(last, changed), next(_versions))


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
        select(Rank.rank.label("rank"), relation_of(head).label("k"), EventRow.phase)
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
        select(RunTally.diverged, _top(), newer.c.rank, newer.c.k, newer.c.phase)
        .select_from(RunTally)
        .outerjoin(newer, true())
        .where(RunTally.run_id == run_id)
    )
