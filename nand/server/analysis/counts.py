"""A big run's ranks by state without reading every rank row.

The ingest keeps a tally per run (``RunTally``, kept by triggers on ``ranks``:
migration 0013) of what it knows for good: ranks seen, diverged, diverged and
gone, crashed, finished. The rest are open ranks, whose state depends on the
clock: lost (``last_seen`` older than ``lost_after_s``), stalled (no step
change for ``stalled_after_s``) or running. Those two are range counts over
partial indexes of the open ranks, so a request reads the tally row and the
index entries of the lost and stalled ranks, never every rank. Same states
and order as ``correlate.rank_state`` (``tests/server/test_big_runs.py``
compares them with every rank loaded).

>>> Tally(ranks=10, diverged=3, diverged_gone=1, crashed=1, finished=2).open
4
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, func, select, union_all
from sqlalchemy.orm import Session

from nand.events import RankState
from nand.server.settings import Settings
from nand.server.storage.models import Rank, Run, RunTally


@dataclass(frozen=True)
class Tally:
    """A run's :class:`RunTally` row (zeros for a run without one)."""

    ranks: int = 0
    diverged: int = 0
    diverged_gone: int = 0
    crashed: int = 0
    finished: int = 0

    @property
    def open(self) -> int:
        """Ranks neither diverged nor gone: lost, stalled or running by the clock."""
        return self.ranks - self.diverged - self.crashed - self.finished


@dataclass(frozen=True)
class StateCounts:
    """A run's ranks by state (only states that occur), and how many a stop reaches."""

    states: dict[RankState, int]
    live: int
    ranks: int


#: The tally's columns in the order of :class:`Tally`'s fields.
TALLY_COLUMNS = (
    RunTally.ranks,
    RunTally.diverged,
    RunTally.diverged_gone,
    RunTally.crashed,
    RunTally.finished,
)


def _open() -> ColumnElement[bool]:
    """The partial indexes' condition (``models.RANK_OPEN``), for the planner to match."""
    return and_(Rank.first_event_id.is_(None), Rank.finished_at.is_(None))


def _lost(run_id: int, lost_before: float) -> ColumnElement[bool]:
    return and_(Rank.run_id == run_id, _open(), Rank.last_seen < lost_before)


def _stalled(run_id: int, lost_before: float, stalled_before: float) -> ColumnElement[bool]:
    return and_(
        Rank.run_id == run_id,
        _open(),
        Rank.step_changed_at < stalled_before,
        Rank.last_seen >= lost_before,
    )


def _crashed(run_id: int, dialect: str) -> ColumnElement[bool]:
    reason = Rank.bye_reason
    # (instr/strpos, not LIKE: LIKE ignores case on SQLite, correlate.crashed_bye does not)
    find = func.strpos if dialect == "postgresql" else func.instr
    return and_(
        Rank.run_id == run_id,
        Rank.first_event_id.is_(None),
        Rank.finished_at.is_not(None),
        func.substr(reason, 1, 10) == "exception:",
        find(reason, "StopRequested") == 0,
    )


def _horizons(settings: Settings, now: float) -> tuple[float, float]:
    # (correlate.rank_state: lost when now - last_seen > lost_after_s)
    return now - settings.lost_after_s, now - settings.stalled_after_s


def state_counts(session: Session, run: Run, settings: Settings, now: float) -> StateCounts:
    """The run's ranks by state: its tally and two indexed range counts, one statement.

    ``settings`` are the run's (``Settings.for_world``)."""
    lost_before, stalled_before = _horizons(settings, now)
    lost = select(func.count()).where(_lost(run.id, lost_before)).scalar_subquery()
    stalled = (
        select(func.count()).where(_stalled(run.id, lost_before, stalled_before)).scalar_subquery()
    )
    row = session.execute(
        select(*TALLY_COLUMNS, lost, stalled).where(RunTally.run_id == run.id)
    ).first()
    tally = Tally(*row[:5]) if row is not None else Tally()
    n_lost, n_stalled = (row[5], row[6]) if row is not None else (0, 0)
    running = tally.open - n_lost - n_stalled
    states: dict[RankState, int] = {
        "diverged": tally.diverged,
        "crashed": tally.crashed,
        "finished": tally.finished,
        "lost": n_lost,
        "stalled": n_stalled,
        "running": running,
    }
    live = tally.diverged - tally.diverged_gone + n_stalled + running
    return StateCounts({k: n for k, n in states.items() if n}, live, tally.ranks)


def ranks_seen(session: Session, run_id: int) -> int:
    """How many ranks the run has (its tally: no count of its rows)."""
    return session.scalar(select(RunTally.ranks).where(RunTally.run_id == run_id)) or 0


def failing_ranks(
    session: Session,
    run_id: int,
    settings: Settings,
    now: float,
    crashed: bool,
    also: int | None = None,
) -> list[tuple[object, ...]]:
    """The rows (``columns``) of the ranks lost, stalled and, if ``crashed`` (the
    tally has some), crashed, and of rank ``also``: one statement, each part indexed."""
    lost_before, stalled_before = _horizons(settings, now)
    wanted = [_lost(run_id, lost_before), _stalled(run_id, lost_before, stalled_before)]
    if crashed:
        wanted.append(_crashed(run_id, session.get_bind().dialect.name))
    if also is not None:
        wanted.append(and_(Rank.run_id == run_id, Rank.rank == also))
    parts = [select(*FACT_COLUMNS).where(condition) for condition in wanted]
    rows = session.execute(union_all(*parts)).all()
    # (``also``, the origin's rank, may be failing too)
    return list({row[0]: tuple(row) for row in rows}.values())


#: The columns of a rank row that ``bigrun.facts`` reads.
FACT_COLUMNS = (
    Rank.rank,
    Rank.step,
    Rank.last_seen,
    Rank.step_changed_at,
    Rank.first_event_id.is_not(None),
    Rank.finished_at,
    Rank.bye_reason,
    Rank.steps_per_s,
    Rank.dropped,
)
