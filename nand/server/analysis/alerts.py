"""Early warnings from the agents: stored, counted, summarised for the verdict.

An agent sends a ``warning`` (``nand.events.Alert``) when a clean step looks
like the start of a blow-up: the loss spikes, the gradient norm grows by an
order of magnitude, an activation nears its dtype's limit
(``nand.agent.step.blowup``). A warning never makes a run ``diverged``; the
verdict carries how many there were and the first (``Verdict.warnings``), the
dashboard marks their steps, and ``nand wait --until warning`` returns on the
first.

One kind comes from the server itself: ``grad_outlier``, a rank whose own
gradients stand out from the other ranks' at the same step
(``nand.server.analysis.outliers``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select
from sqlalchemy import update as sql_update
from sqlalchemy.orm import Session

from nand.events import WARNING_KINDS, WarningKind
from nand.server.schemas.warnings import WarningOut, WarningsSummary
from nand.server.storage.models import Run, WarningRow
from nand.server.storage.runids import RunIds
from nand.server.storage.sanitize import clean_str


def store(conn: Connection, messages: list[dict[str, Any]], run_ids: RunIds) -> None:
    """Insert a batch's warnings and count them on their runs."""
    if messages:
        insert_rows(conn, [_row(message, run_ids) for message in messages])


def insert_rows(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert warning rows (``warnings`` columns) and count them on their runs;
    the server's own warnings (``outliers``) come in here too."""
    conn.execute(insert(WarningRow), rows)
    added: Counter[int] = Counter(row["run_id"] for row in rows)
    conn.execute(
        sql_update(Run)
        .where(Run.id == bindparam("rid"))
        .values(warning_count=Run.warning_count + bindparam("n")),
        [{"rid": run_id, "n": n} for run_id, n in added.items()],
    )


def _row(message: dict[str, Any], run_ids: RunIds) -> dict[str, Any]:
    body = message["body"]
    return {
        "run_id": run_ids.of(message),
        "rank": message["rank"],
        "step": body["step"],
        "kind": body["kind"],
        "module": clean_str(body.get("module"), 512),
        "value": _finite(body.get("value")),
        "reference": _finite(body.get("reference")),
        "message": clean_str(body.get("message"), 2000),
        "time": float(message["time"]),
    }


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and abs(value) < float("inf") else None


def of_run(session: Session, run_id: int, limit: int = 500) -> list[WarningOut]:
    """A run's warnings in step order (then rank), at most ``limit``."""
    rows = session.scalars(
        select(WarningRow)
        .where(WarningRow.run_id == run_id)
        .order_by(WarningRow.step, WarningRow.rank, WarningRow.id)
        .limit(limit)
    )
    return [_out(row) for row in rows]


def summary(session: Session, run: Run) -> WarningsSummary:
    """The verdict's ``warnings``: how many, by kind, and the first."""
    if not run.warning_count:
        return WarningsSummary()
    by_kind = dict(
        session.execute(
            select(WarningRow.kind, func.count())
            .where(WarningRow.run_id == run.id)
            .group_by(WarningRow.kind)
        ).all()
    )
    first = of_run(session, run.id, limit=1)
    return WarningsSummary(
        count=sum(by_kind.values()), by_kind=by_kind, first=first[0] if first else None
    )


def by_kind_live(session: Session) -> dict[str, int]:
    """Warnings of the live runs by kind, for ``/metrics``."""
    found: dict[str, int] = defaultdict(int)
    statement = (
        select(WarningRow.kind, func.count())
        .join(Run, Run.id == WarningRow.run_id)
        .where(Run.superseded_at.is_(None))
        .group_by(WarningRow.kind)
    )
    for kind, n in session.execute(statement).all():
        found[kind] += n
    return dict(found)


def warning_kind(value: str) -> WarningKind:
    """A stored kind as a :data:`WarningKind` (checked on the wire)."""
    for kind in WARNING_KINDS:
        if kind == value:
            return kind
    raise ValueError(f"unknown warning kind {value!r}")


def _out(row: WarningRow) -> WarningOut:
    return WarningOut(
        rank=row.rank,
        step=row.step,
        kind=warning_kind(row.kind),
        module=row.module,
        value=row.value,
        reference=row.reference,
        message=row.message,
        time=row.time,
    )
