"""``GET /api/runs/{run}/series``: heartbeat telemetry per rank, downsampled, in one
statement whatever the number of ranks (it was one per rank: 100,000 at 100,000).

Each rank's heartbeats are numbered (``row_number``) and counted (``count``)
by window functions over the rank, then cut into at most ``points`` buckets
of equal count; ``grad_norm`` and ``max_activation`` keep the bucket's maximum
(a spike must stay visible), the others its mean. Ranks come a page at a
time (``after``, ``limit``), so the body of a 100,000-rank run stays bounded.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from nand.server.storage.models import Heartbeat, Rank

Point = tuple[float, int, float | None, float | None, float | None, float | None]


def series(
    session: Session, run_id: int, points: int, after: int | None = None, limit: int | None = None
) -> dict[int, list[Point]]:
    """Heartbeats of the ranks above ``after`` (at most ``limit`` ranks), by rank."""
    inner = _numbered(run_id, after, _last_rank(session, run_id, after, limit)).subquery()
    stride = (inner.c.total + (points - 1)) // points
    bucket = (inner.c.n - 1) // stride
    statement = (
        select(
            inner.c.rank,
            func.max(inner.c.time),
            func.max(inner.c.step),
            func.avg(inner.c.loss),
            func.max(inner.c.grad_norm),
            func.avg(inner.c.steps_per_s),
            func.max(inner.c.max_activation),
        )
        .group_by(inner.c.rank, bucket)
        .order_by(inner.c.rank, bucket)
    )
    result: dict[int, list[Point]] = {}
    for rank, *point in session.execute(statement):
        result.setdefault(rank, []).append(tuple(point))
    return result


def _numbered(run_id: int, after: int | None, last: int | None) -> Select[Any]:
    statement = select(
        Heartbeat.rank,
        Heartbeat.time,
        Heartbeat.step,
        Heartbeat.loss,
        Heartbeat.grad_norm,
        Heartbeat.steps_per_s,
        Heartbeat.max_activation,
        func.row_number().over(partition_by=Heartbeat.rank, order_by=Heartbeat.id).label("n"),
        func.count().over(partition_by=Heartbeat.rank).label("total"),
    ).where(Heartbeat.run_id == run_id)
    if after is not None:
        statement = statement.where(Heartbeat.rank > after)
    if last is not None:
        statement = statement.where(Heartbeat.rank <= last)
    return statement


def _last_rank(session: Session, run_id: int, after: int | None, limit: int | None) -> int | None:
    """The highest rank of the page (None: no limit, or fewer ranks than it)."""
    if limit is None:
        return None
    # (the rank rows, in rank order: ix_ranks_run_rank)
    statement = select(Rank.rank).where(Rank.run_id == run_id).order_by(Rank.rank)
    if after is not None:
        statement = statement.where(Rank.rank > after)
    return session.scalar(statement.offset(limit - 1).limit(1))
