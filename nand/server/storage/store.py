"""Read queries and the few writes the REST API makes (stop, prune).

Everything takes a SQLAlchemy ``Session``; callers own the transaction. The
verdict path reads only the run row, its rank rows joined to their cached
first events, and one flight-evidence row: no scan of the events table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Select, delete, func, select, update
from sqlalchemy.orm import Session

from nand.server.storage.db import chunks
from nand.server.storage.models import (
    Agent,
    AgentLease,
    Drop,
    EventRow,
    Flight,
    Heartbeat,
    Message,
    Rank,
    Run,
)


@dataclass(frozen=True)
class EventFilter:
    rank: int | None = None
    phase: str | None = None
    module: str | None = None
    step_min: int | None = None
    step_max: int | None = None


def run_by_name(session: Session, name: str, attempt: int | None = None) -> Run | None:
    """The live attempt of a run, or attempt number ``attempt``."""
    statement = select(Run).where(Run.name == name)
    if attempt is None:
        statement = statement.where(Run.superseded_at.is_(None))
    else:
        statement = statement.where(Run.attempt == attempt)
    return session.scalars(statement.order_by(Run.attempt.desc()).limit(1)).first()


def attempts_of(session: Session, name: str) -> Sequence[Run]:
    """Every attempt of a run, oldest first."""
    return session.scalars(select(Run).where(Run.name == name).order_by(Run.attempt)).all()


def recent_runs(session: Session, limit: int, offset: int = 0) -> Sequence[Run]:
    """Live attempts, most recently seen first (older attempts: by name and attempt)."""
    statement = (
        select(Run).where(Run.superseded_at.is_(None)).order_by(Run.last_seen.desc(), Run.id.desc())
    )
    return session.scalars(statement.offset(offset).limit(limit)).all()


def runs_updated_since(
    session: Session, since: float, active_since: float, names: set[str] | None = None
) -> Sequence[Run]:
    """Live runs changed after ``since`` or seen after ``active_since`` (their state
    may age); ``names``: only these runs."""
    changed = (Run.updated_at >= since) | (Run.last_seen >= active_since)
    statement = select(Run).where(changed, Run.superseded_at.is_(None))
    if names is not None:
        statement = statement.where(Run.name.in_(sorted(names)))
    return session.scalars(statement.order_by(Run.id).limit(1000)).all()


def ranks_of(
    session: Session, run_ids: Sequence[int]
) -> dict[int, list[tuple[Rank, EventRow | None]]]:
    """Rank rows of the given runs, each with its cached first event, in rank order."""
    result: dict[int, list[tuple[Rank, EventRow | None]]] = {run_id: [] for run_id in run_ids}
    if not run_ids:
        return result
    statement = (
        select(Rank, EventRow)
        .outerjoin(EventRow, EventRow.id == Rank.first_event_id)
        .where(Rank.run_id.in_(run_ids))
        .order_by(Rank.run_id, Rank.rank)
    )
    for rank, event in session.execute(statement).all():
        result[rank.run_id].append((rank, event))
    return result


def latest_flight(session: Session, run_id: int, rank: int) -> Flight | None:
    statement = (
        select(Flight)
        .where(Flight.run_id == run_id, Flight.rank == rank)
        .order_by(Flight.id.desc())
        .limit(1)
    )
    return session.scalars(statement).first()


def flight_scale(session: Session, run_id: int) -> tuple[float | None, float | None]:
    """The smallest and largest positive finite max|x| over every window of a run."""
    statement = select(func.min(Flight.mag_min), func.max(Flight.mag_max)).where(
        Flight.run_id == run_id
    )
    low, high = session.execute(statement).one()
    return low, high


def ranks_with_flight(
    session: Session, run_id: int, between: tuple[int, int] | None = None
) -> set[int]:
    """The ranks of a run (``between`` these two, inclusive: a page's) that sent at
    least one flight-recorder window."""
    statement = select(Flight.rank).where(Flight.run_id == run_id).distinct()
    if between is not None:
        # (a range of ix_flights_run_rank: a page need not read every diverged rank's)
        statement = statement.where(Flight.rank.between(*between))
    return set(session.scalars(statement))


def flight_evidence_row(session: Session, run_id: int, rank: int) -> tuple[bool, bool, str] | None:
    """The precomputed evidence of a rank's latest flight window (not its data)."""
    statement = (
        select(Flight.overflow, Flight.grad_rising, Flight.evidence)
        .where(Flight.run_id == run_id, Flight.rank == rank)
        .order_by(Flight.id.desc())
        .limit(1)
    )
    row = session.execute(statement).first()
    return (bool(row[0]), bool(row[1]), row[2]) if row else None


def recent_grad_norms(
    session: Session, run_id: int, rank: int, up_to_step: int, n: int = 32
) -> list[tuple[int, float | None]]:
    """The last ``n`` heartbeats ``(step, grad_norm)`` of a rank up to a step, oldest first."""
    statement = (
        select(Heartbeat.step, Heartbeat.grad_norm)
        .where(Heartbeat.run_id == run_id, Heartbeat.rank == rank, Heartbeat.step <= up_to_step)
        .order_by(Heartbeat.id.desc())
        .limit(n)
    )
    return [(int(step), norm) for step, norm in reversed(session.execute(statement).all())]


def _filtered(statement: Select, run_id: int, where: EventFilter) -> Select:
    statement = statement.where(EventRow.run_id == run_id)
    if where.rank is not None:
        statement = statement.where(EventRow.rank == where.rank)
    if where.phase is not None:
        statement = statement.where(EventRow.phase == where.phase)
    if where.module is not None:
        statement = statement.where(EventRow.module == where.module)
    if where.step_min is not None:
        statement = statement.where(EventRow.step >= where.step_min)
    if where.step_max is not None:
        statement = statement.where(EventRow.step <= where.step_max)
    return statement


def events_page(
    session: Session, run_id: int, where: EventFilter, offset: int, limit: int
) -> tuple[Sequence[EventRow], int]:
    """One page of a run's events in logical order, and how many match in all."""
    total = session.scalar(_filtered(select(func.count(EventRow.id)), run_id, where)) or 0
    order = (
        EventRow.step,
        EventRow.micro_step,
        EventRow.phase_rank,
        EventRow.ord,
        EventRow.rank,
        EventRow.id,
    )
    statement = _filtered(select(EventRow), run_id, where).order_by(*order)
    return session.scalars(statement.offset(offset).limit(limit)).all(), int(total)


def request_stop(session: Session, run_id: int, step: int, reason: str, now: float) -> None:
    """Record a stop unless one is already recorded (the first request wins)."""
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.stop_step.is_(None))
        .values(stop_step=step, stop_requested_at=now, stop_reason=reason, updated_at=now)
    )


def stops_requested_since(session: Session, since: float) -> Sequence[tuple[str, int, int]]:
    """(run name, run id, stop step) of stops recorded after ``since``."""
    statement = select(Run.name, Run.id, Run.stop_step).where(
        Run.stop_requested_at >= since, Run.stop_step.is_not(None), Run.superseded_at.is_(None)
    )
    return [(name, run_id, int(step or 0)) for name, run_id, step in session.execute(statement)]


def prune(session: Session, older_than: float) -> list[str]:
    """Delete every run last seen before ``older_than`` with all its rows; their names."""
    doomed = session.execute(select(Run.id, Run.name).where(Run.last_seen < older_than)).all()
    ids = [run_id for run_id, _ in doomed]
    for chunk in chunks(ids):
        for table in (EventRow, Heartbeat, Flight, Message, Agent, Drop, Rank):
            session.execute(delete(table).where(table.run_id.in_(chunk)))
        session.execute(delete(Run).where(Run.id.in_(chunk)))
    # A killed server never releases its leases; long expired, they name nobody.
    session.execute(delete(AgentLease).where(AgentLease.expires < older_than))
    return sorted({name for _, name in doomed})
