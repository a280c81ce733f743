"""A rank whose own gradients stand out from the other ranks' at one step.

Under DDP every rank computes gradients on its own batch and the all-reduce
averages them: afterwards every rank holds the same gradients, and a rank fed
a poisoned batch (a sample scaled by 1000, targets in the wrong units) or
whose hardware computes wrong no longer shows. Before it, nand's
communication hook takes the norm of each rank's own gradients
(``nand.agent.detect.ddp``). Heartbeats carry those norms
(``local_grad_norms``); they wait here, one row per rank and step, until every
rank's norm for a step is in, and are then compared and deleted. The job runs
no collective for this.

The comparison, in :func:`standing_out`, is on a log scale (a norm 10 times
too large is as far off as one 10 times too small), around the median of the
ranks' norms, which one odd rank cannot move. A rank stands out when its norm
is over ``factor`` times the median or under ``1/factor`` of it
(``NAND_GRAD_OUTLIER_FACTOR``, 10), *and* further from it than
:data:`MAD_LIMIT` robust standard deviations (1.4826 median absolute
deviations), so that ranks whose norms are spread widely on every healthy
step do not warn on their spread. It takes :data:`MIN_RANKS` ranks: with two,
nobody can tell which one is off (so a smaller run's norms are not kept at all).

Each finding is a ``grad_outlier`` warning (``nand.server.analysis.alerts``) naming the
rank and the step; a rank that goes on standing out warns again only
:data:`QUIET_STEPS` steps later. A step that some rank never reports (it died,
or more steps passed between two of its heartbeats than one carries) is
dropped uncompared once :data:`KEEP_STEPS` newer steps are in, and a norm
that arrives for such a step (a late rank's, a replayed spool's) is not kept.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, exists, select, text

from nand.server.analysis import alerts
from nand.server.storage import bulk
from nand.server.storage.db import chunks, insert_ignoring_conflicts
from nand.server.storage.models import LocalGradNorm, WarningRow
from nand.server.storage.runids import RunIds

#: Fewest ranks whose norms can single one out.
MIN_RANKS = 3
#: How many robust standard deviations off a rank must also be.
MAD_LIMIT = 5.0
#: Steps before the same rank warns again.
QUIET_STEPS = 100
#: Steps a run's incomplete rows are kept, behind its newest; they are
#: pruned each time a run's heartbeats pass a multiple of PRUNE_EVERY steps.
KEEP_STEPS = 1024
PRUNE_EVERY = 256
#: 1.4826 * MAD estimates the standard deviation of normal data.
MAD_TO_SIGMA = 1.4826
KIND = "grad_outlier"


@dataclass(frozen=True)
class Outlier:
    """A rank's local gradient norm against the median of ``ranks`` ranks'."""

    rank: int
    norm: float
    median: float
    ranks: int


def standing_out(norms: Mapping[int, float], factor: float) -> list[Outlier]:
    """The ranks whose norm stands out from the others' (see the module doc).

    >>> [(o.rank, o.norm, round(o.median, 3)) for o in standing_out(
    ...     {0: 1.0, 1: 1.3, 2: 900.0, 3: 0.8}, factor=10)]
    [(2, 900.0, 1.14)]
    >>> standing_out({0: 1.0, 1: 0.0, 2: 1.1}, factor=10)[0].rank
    1
    >>> standing_out({0: 1.0, 1: 9.0, 2: 0.2, 3: 40.0, 4: 3.0}, factor=10)  # a wide spread
    []
    >>> standing_out({0: 1.0, 1: 900.0}, factor=10)  # two: which one?
    []
    """
    if len(norms) < MIN_RANKS:
        return []
    if _within_factor(norms.values(), factor):
        return []
    logs = {rank: math.log(norm) for rank, norm in norms.items() if norm > 0}
    if len(logs) * 2 <= len(norms):
        return []  # most ranks had no gradient at all: nothing to measure against
    center = statistics.median(logs.values())
    spread = MAD_TO_SIGMA * statistics.median(abs(v - center) for v in logs.values())
    limit = max(math.log(factor), MAD_LIMIT * spread)
    median = math.exp(center)
    return [
        Outlier(rank, norm, median, len(norms))
        for rank, norm in sorted(norms.items())
        if norm <= 0 or abs(math.log(norm) - center) > limit
    ]


def _within_factor(norms: Iterable[float], factor: float) -> bool:
    """All norms positive and within ``factor`` of each other, with room to spare
    for rounding: then none is further than ``log(factor)`` from the median of
    their logs, which lies between the smallest and the largest, so none stands
    out (the usual step, told apart without a logarithm or a median)."""
    low, high = min(norms), max(norms)
    return low > 0 and high < low * factor * (1 - 1e-9)


def store(conn: Connection, beats: list[dict[str, Any]], run_ids: RunIds, factor: float) -> None:
    """Compare each step every rank has now sent; keep the others' norms waiting."""
    incoming: dict[int, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for beat in beats:
        run_id, rank = run_ids.of(beat), beat["rank"]
        for step, norm in beat["body"].get("local_grad_norms") or ():
            incoming[run_id][step][rank] = float(norm)
    for run_id, steps in incoming.items():
        _store_run(conn, run_id, steps, factor)


def _store_run(
    conn: Connection, run_id: int, steps: dict[int, dict[int, float]], factor: float
) -> None:
    """One run's new norms, with those already waiting for the same steps:
    complete steps are compared (and their waiting rows deleted), the rest wait."""
    first, last = min(steps), max(steps)
    world_size, newest = conn.execute(_RUN_FACTS, {"run_id": run_id}).one()
    if world_size < MIN_RANKS:
        return  # never compared (a hello says the world size before any norm): kept nowhere
    # Steps KEEP_STEPS behind the run's newest are given up (the prune's rule): a
    # late rank's norms for them (a spool replayed, a rank far behind) do not wait.
    horizon = max(newest, last) - KEEP_STEPS
    waiting = _waiting(conn, run_id, max(first, horizon), last) if last >= horizon else []
    new_rows = [(step, rank) for step, norms in steps.items() if step >= horizon for rank in norms]
    for step, rank, norm in waiting:
        steps[step].setdefault(rank, norm)
    complete = sorted(s for s, norms in steps.items() if len(norms) >= world_size)
    for step in complete:
        for outlier in standing_out(steps[step], factor):
            _warn(conn, run_id, step, outlier)
    done = set(complete)
    _forget(conn, run_id, sorted({step for step, _, _ in waiting if step in done}))
    rows = [(run_id, s, r, steps[s][r]) for s, r in new_rows if s not in done]
    _insert_waiting(conn, rows)
    if last // PRUNE_EVERY * PRUNE_EVERY >= first:  # (each rank's beats cover every step)
        conn.execute(_PRUNE, {"run_id": run_id, "before": last - KEEP_STEPS})


# Plain SQL for the statements every heartbeat runs: building them with the
# expression language each time was most of what a heartbeat's norms cost.
_RUN_FACTS = text("SELECT world_size, latest_step FROM runs WHERE id = :run_id")
_WAITING = text(
    "SELECT step, rank, norm FROM local_grad_norms "
    "WHERE run_id = :run_id AND step BETWEEN :first AND :last"
)
_WAITING_SQLITE = (
    "SELECT step, rank, norm FROM local_grad_norms WHERE run_id = ? AND step BETWEEN ? AND ?"
)
_PRUNE = text("DELETE FROM local_grad_norms WHERE run_id = :run_id AND step < :before")


def _waiting(conn: Connection, run_id: int, first: int, last: int) -> Sequence[Any]:
    """``(step, rank, norm)`` of the rows waiting for steps ``first`` to ``last``;
    on SQLite as the driver's tuples (thousands a batch at full rate)."""
    if conn.dialect.name == "sqlite":
        found = conn.exec_driver_sql(_WAITING_SQLITE, (run_id, first, last))
        return found.cursor.fetchall()
    return list(conn.execute(_WAITING, {"run_id": run_id, "first": first, "last": last}))


def _insert_waiting(conn: Connection, rows: list[tuple[int, int, int, float]]) -> None:
    """Insert ``(run_id, step, rank, norm)`` rows, ignoring ones already there
    (a heartbeat sent again); on SQLite straight to the driver (a heartbeat
    carries hundreds: SQLAlchemy's per-row processing would be most of it)."""
    if not rows:
        return
    if conn.dialect.name == "sqlite":
        head = "INSERT OR IGNORE INTO local_grad_norms (run_id, step, rank, norm)"
        bulk.insert(conn.exec_driver_sql, head, 4, rows)
        return
    columns = ("run_id", "step", "rank", "norm")
    statement = insert_ignoring_conflicts(conn, LocalGradNorm.__table__)
    conn.execute(statement, [dict(zip(columns, row, strict=True)) for row in rows])


def _forget(conn: Connection, run_id: int, steps: list[int]) -> None:
    """Delete the waiting rows of steps now compared."""
    for chunk in chunks(steps):
        conn.execute(_FORGET, {"run_id": run_id, "steps": chunk})


_FORGET = text("DELETE FROM local_grad_norms WHERE run_id = :run_id AND step IN :steps").bindparams(
    bindparam("steps", expanding=True)
)


def _warn(conn: Connection, run_id: int, step: int, outlier: Outlier) -> None:
    """A ``grad_outlier`` warning, unless this rank had one in the last
    :data:`QUIET_STEPS` steps (either side: heartbeats arrive out of order)."""
    recent = exists().where(
        WarningRow.run_id == run_id,
        WarningRow.kind == KIND,
        WarningRow.rank == outlier.rank,
        WarningRow.step.between(step - QUIET_STEPS, step + QUIET_STEPS),
    )
    if conn.execute(select(recent)).scalar():
        return
    row = {
        "run_id": run_id,
        "rank": outlier.rank,
        "step": step,
        "kind": KIND,
        "module": "",
        "value": outlier.norm,
        "reference": outlier.median,
        "message": sentence(outlier, step),
        "time": time.time(),
    }
    alerts.insert_rows(conn, [row])


def sentence(outlier: Outlier, step: int) -> str:
    """The finding in words a person on call can act on (the rank is the
    warning's own field, as with the agents' warnings).

    >>> print(sentence(Outlier(rank=2, norm=900.0, median=1.2, ranks=4), 57))
    own gradient norm at step 57, before the all-reduce, is 750x the median of the 4 ranks' (900 against 1.2): its batch differs from the others' (bad data, a poisoned sample, targets in other units) or its hardware computes wrong
    """  # noqa: E501
    if outlier.norm <= 0:
        how = f"zero, against a median of {outlier.median:.3g} over the {outlier.ranks} ranks"
    else:
        ratio = outlier.norm / outlier.median
        times = f"{ratio:,.0f}x" if ratio >= 1 else f"1/{1 / ratio:,.0f}"
        how = (
            f"{times} the median of the {outlier.ranks} ranks' "
            f"({outlier.norm:.3g} against {outlier.median:.3g})"
        )
    return (
        f"own gradient norm at step {step:,}, before the all-reduce, is {how}: its batch "
        "differs from the others' (bad data, a poisoned sample, targets in other units) or "
        "its hardware computes wrong"
    )
