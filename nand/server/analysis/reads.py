"""The read facade: a run's summary, verdict and detail, each read the way the
run's size asks, chosen here once instead of at every caller.

A small run (``world_size <= Settings.big_run_ranks``) is read from all its
rank rows, loaded in one query for every small run asked about at once
(:mod:`views`); a big run by statements that count and pick in the database
without loading every rank (:mod:`bigrun`, :func:`rankpage.run_summary`).
Both give the same answer (``tests/server/test_big_runs.py``,
``tests/server/test_scale.py``).

Use::

    reads = Reads(session, settings, runs)   # the small runs' ranks, one query
    for run in runs:
        summary = reads.summary(run, now)
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from nand.server.analysis import bigrun, rankpage, views
from nand.server.schemas.runs import RunDetail, RunSummary
from nand.server.schemas.verdict import Verdict
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Run


class Reads:
    """Summaries, verdicts and details of ``runs`` (read from ``session``)."""

    def __init__(self, session: Session, settings: Settings, runs: Sequence[Run]) -> None:
        self.session = session
        self.settings = settings
        small = [run.id for run in runs if not self.is_big(run)]
        self._ranks = store.ranks_of(session, small)

    def is_big(self, run: Run) -> bool:
        """Read by the database's counts, not by loading every rank."""
        return run.world_size > self.settings.big_run_ranks

    def _rows(self, run: Run) -> views.RankRows | None:
        if self.is_big(run):
            return None
        rows = self._ranks.get(run.id)
        if rows is None:  # a run not given at the start: read it now
            rows = self._ranks[run.id] = store.ranks_of(self.session, [run.id])[run.id]
        return rows

    def summary(self, run: Run, now: float) -> RunSummary:
        rows = self._rows(run)
        if rows is None:
            return rankpage.run_summary(self.session, run, self.settings, now)
        return views.run_summary(run, rows, self.settings, now)

    def verdict(self, run: Run, now: float) -> Verdict:
        rows = self._rows(run)
        if rows is None:
            return bigrun.verdict(self.session, run, self.settings, now)
        return views.verdict(self.session, run, rows, self.settings, now)

    def run_detail(self, run: Run, now: float) -> RunDetail:
        rows = self._rows(run)
        if rows is None:
            return bigrun.run_detail(self.session, run, self.settings, now)
        return views.run_detail(self.session, run, rows, self.settings, now)


def summaries(
    session: Session, settings: Settings, runs: Sequence[Run], now: float
) -> list[RunSummary]:
    """Each run's summary, in the order given."""
    reads = Reads(session, settings, runs)
    return [reads.summary(run, now) for run in runs]
